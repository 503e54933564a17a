"""`helm upgrade` against what is already there: Redis' volume claims cannot change.

The chart looks the StatefulSet up (`lookup`) and names the changed value; the API
server would refuse the upgrade with a message that names none. A small stand-in for
the API server answers Helm's discovery and the StatefulSet's GET, and `helm template
--dry-run=server` renders against it as `helm upgrade` does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from support.helm import CHART, NAMESPACE, RELEASE, run_helm, template_args

STATEFULSET = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{RELEASE}-redis"


def _plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + ("es" if lower.endswith("s") else "s")


def discovery(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What Helm asks before it renders against a cluster: the version, and the API
    groups and resources of every kind the chart makes (it maps each object to one)."""
    resources: dict[str, dict[str, dict[str, Any]]] = {}
    for manifest in manifests:
        kind, namespaced = manifest["kind"], "namespace" in manifest["metadata"]
        resource = {"name": _plural(kind), "kind": kind, "namespaced": namespaced, "verbs": []}
        resources.setdefault(manifest["apiVersion"], {})[kind] = resource
    answers: dict[str, dict[str, Any]] = {
        "/version": {"major": "1", "minor": "33", "gitVersion": "v1.33.0"},
        "/api": {"kind": "APIVersions", "versions": ["v1"]},
    }
    groups = []
    for version, kinds in resources.items():
        listed = {"kind": "APIResourceList", "groupVersion": version}
        answers["/api/v1" if version == "v1" else f"/apis/{version}"] = {
            **listed,
            "resources": list(kinds.values()),
        }
        if version != "v1":
            entry = {"groupVersion": version, "version": version.split("/")[1]}
            groups.append(
                {"name": version.split("/")[0], "versions": [entry], "preferredVersion": entry}
            )
    answers["/apis"] = {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    return answers


class _Server(ThreadingHTTPServer):
    # Helm asks for every API group at once; past the default backlog of 5, a dropped
    # connection waits out a 1 s retransmit.
    request_queue_size = 64


class FakeApi:
    """Discovery, plus the objects in `objects` by path; 404 for anything else."""

    def __init__(self, discovery: dict[str, dict[str, Any]]) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                body = discovery.get(path) or api.objects.get(path)
                status = 200 if body else 404
                if body is None:
                    body = {"kind": "Status", "status": "Failure", "reason": "NotFound"}
                    body |= {"apiVersion": "v1", "code": 404}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def server(renders, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeApi]:
    """One stand-in for the module (Helm's discovery cache then serves every test)."""
    fake = FakeApi(discovery([m for manifests in renders.values() for m in manifests]))
    thread = threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    home = tmp_path_factory.mktemp("kube")
    kubeconfig = home / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(kubeconfig))
        # Helm caches discovery per server, by default in ~/.kube/cache.
        patch.setenv("KUBECACHEDIR", str(home / "cache"))
        yield fake
    fake.server.shutdown()
    fake.server.server_close()
    thread.join()


@pytest.fixture
def api(server: FakeApi) -> FakeApi:
    server.objects.clear()
    return server


def _redis(claim: dict[str, Any] | None) -> dict[str, Any]:
    """The Redis StatefulSet as the API server returns it, with this claim template."""
    spec: dict[str, Any] = {"replicas": 1, "serviceName": f"{RELEASE}-redis"}
    if claim is not None:
        template = {"metadata": {"name": "data"}, "spec": claim}
        spec["volumeClaimTemplates"] = [template]
    # Made by this release: Helm checks that before it takes an object over.
    metadata = {
        "name": f"{RELEASE}-redis",
        "namespace": NAMESPACE,
        "labels": {"app.kubernetes.io/managed-by": "Helm"},
        "annotations": {
            "meta.helm.sh/release-name": RELEASE,
            "meta.helm.sh/release-namespace": NAMESPACE,
        },
    }
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": spec}


def _claim(storage: str, storage_class: str | None = None) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": storage}},
        "volumeMode": "Filesystem",
    }
    if storage_class is not None:
        claim["storageClassName"] = storage_class
    return claim


def _upgrade(helm: str, sets: list[str]):
    """The render `helm upgrade` makes: lookup answered by the cluster."""
    return run_helm(
        helm, *template_args(CHART, sets=sets), "--dry-run=server", "--disable-openapi-validation"
    )


HOW = (
    "Kubernetes refuses any change to a StatefulSet's volume claims. Keep the value it was "
    'made with, or see "Changing Redis\' volume" in docs/guide.md (in short: kubectl delete '
    f"statefulset {RELEASE}-redis --namespace {NAMESPACE} --cascade=orphan, then upgrade again)"
)

REDIS = f"the Redis StatefulSet {RELEASE}-redis"
# (the claim template there, --set assignments, what the message says is wrong).
CHANGED = [
    (_claim("8Gi"), ["redis.persistence.size=16Gi"], f"size is 16Gi but {REDIS} claims 8Gi"),
    (
        _claim("8Gi"),
        ["redis.persistence.storageClass=fast"],
        f'storageClass is "fast" but {REDIS} claims storage class ""',
    ),
    (_claim("8Gi", "fast"), [], f'storageClass is "" but {REDIS} claims storage class "fast"'),
    (
        _claim("8Gi"),
        ["redis.persistence.enabled=false"],
        f"enabled is false but {REDIS} was made with it true",
    ),
    (None, [], f"enabled is true but {REDIS} was made with it false"),
]


@pytest.mark.parametrize(
    ("claim", "sets", "problem"), CHANGED, ids=[c[2].split(" but")[0] for c in CHANGED]
)
def test_a_changed_claim_is_refused_naming_the_value(helm, api, claim, sets, problem):
    api.objects[STATEFULSET] = _redis(claim)
    result = _upgrade(helm, sets)
    assert result.returncode != 0, "the upgrade rendered"
    assert f"redis.persistence.{problem}, and {HOW}" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("claim", "sets"),
    [
        (_claim("8Gi"), []),
        # The API server writes 8192Mi back as 8Gi: the same size.
        (_claim("8Gi"), ["redis.persistence.size=8192Mi"]),
        (_claim("10"), ["redis.persistence.size=10"]),
        (
            _claim("16Gi", "fast"),
            ["redis.persistence.size=16Gi", "redis.persistence.storageClass=fast"],
        ),
        (None, ["redis.persistence.enabled=false"]),
        # To an external Redis: the StatefulSet goes, nothing of it is kept.
        (_claim("8Gi"), ["redis.enabled=false", "redis.external.url=redis://r:6379/0"]),
    ],
)
def test_an_unchanged_claim_upgrades(helm, api, claim, sets):
    api.objects[STATEFULSET] = _redis(claim)
    result = _upgrade(helm, sets)
    assert result.returncode == 0, result.stderr


def test_a_first_install_has_nothing_to_compare(helm, api):
    result = _upgrade(helm, ["redis.persistence.size=16Gi"])
    assert result.returncode == 0, result.stderr


def test_without_a_cluster_nothing_is_looked_up(helm):
    # helm template and helm lint: lookup answers nothing, and the values are all there is.
    result = run_helm(helm, *template_args(CHART, sets=["redis.persistence.size=16Gi"]))
    assert result.returncode == 0, result.stderr
