"""`helm upgrade` against what is already there: Redis' volume claims cannot change.

The chart looks the StatefulSet up (`lookup`) and names the changed value; the API
server would refuse the upgrade with a message that names none. The emulated API
server the operator's tests use (support.kube_api) holds the StatefulSet, and
`helm template --dry-run=server` renders against it as `helm upgrade` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from support.helm import CHART, NAMESPACE, RELEASE, ROOT, run_helm, template_args
from support.kube_api import ApiServer

from tandem.operator.crd import root_schema

STATEFULSETS = kmock.resource("apps", "v1", "statefulsets")


class Cluster:
    """The emulated API server on its own loop and thread, for Helm's synchronous calls."""

    def __init__(self, without: tuple[kmock.resource, ...] = ()) -> None:
        self.api = ApiServer(crd_schema=root_schema())
        for resource in without:  # CRDs not installed
            del self.api.resources[resource]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self.run(self._enter())

    async def _enter(self) -> Any:
        server = kmock.Server(self.api)
        await server.__aenter__()
        return server

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    @property
    def url(self) -> str:
        return str(self._server.url)

    def redis(self, statefulset: dict[str, Any] | None) -> None:
        """The Redis StatefulSet the cluster holds (None: there is none)."""
        name = f"{RELEASE}-redis"
        if self.api.read(STATEFULSETS, NAMESPACE, name) is not None:
            self.run(self.api.delete(STATEFULSETS, NAMESPACE, name))
        if statefulset is not None:
            self.run(self.api.create(STATEFULSETS, NAMESPACE, statefulset))

    def close(self) -> None:
        self.run(self._server.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


@contextlib.contextmanager
def _pointed_at(emulated: Cluster, home: Path) -> Iterator[Cluster]:
    """Helm's kubeconfig and discovery cache set for `emulated`, then it closes."""
    kubeconfig = home / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emulated", "cluster": {"server": emulated.url}}],
                "users": [{"name": "emulated", "user": {}}],
                "contexts": [
                    {"name": "emulated", "context": {"cluster": "emulated", "user": "emulated"}}
                ],
                "current-context": "emulated",
            }
        )
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KUBECONFIG", str(kubeconfig))
            # Helm caches discovery per server, by default in ~/.kube/cache.
            patch.setenv("KUBECACHEDIR", str(home / "cache"))
            yield emulated
    finally:
        emulated.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module (Helm's discovery cache then serves every test)."""
    with _pointed_at(Cluster(), tmp_path_factory.mktemp("kube")) as emulated:
        yield emulated


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
def test_a_changed_claim_is_refused_naming_the_value(helm, cluster, claim, sets, problem):
    cluster.redis(_redis(claim))
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
        (_claim("8Gi"), ["redis.enabled=false", "redis.external.url=redis://r.db.svc:6379/0"]),
    ],
)
def test_an_unchanged_claim_upgrades(helm, cluster, claim, sets):
    cluster.redis(_redis(claim))
    result = _upgrade(helm, sets)
    assert result.returncode == 0, result.stderr


def test_a_first_install_has_nothing_to_compare(helm, cluster):
    cluster.redis(None)
    result = _upgrade(helm, ["redis.persistence.size=16Gi"])
    assert result.returncode == 0, result.stderr


def test_without_a_cluster_nothing_is_looked_up(helm):
    # helm template and helm lint: lookup answers nothing, and the values are all there is.
    result = run_helm(helm, *template_args(CHART, sets=["redis.persistence.size=16Gi"]))
    assert result.returncode == 0, result.stderr


def test_the_guide_upgrades_on_the_new_charts_defaults(helm):
    # --reuse-values keeps the old chart's defaults: a key a newer chart adds is missing,
    # and the schema, which requires every key, refuses the upgrade.
    guide = (ROOT / "docs" / "guide.md").read_text()
    upgrades = re.findall(r"^helm upgrade .*$", guide, re.M)
    assert upgrades
    for command in upgrades:
        assert "--reuse-values" not in command.split(), command
        assert "--reset-then-reuse-values" in command.split(), command
    assert "Helm 3.14" in guide  # where the flag came in
    assert "--reset-then-reuse-values" in run_helm(helm, "upgrade", "--help").stdout


PEERINGS = kmock.resource("kopf.dev", "v1", "clusterkopfpeerings")


def _peering_names(rendered: str) -> tuple[str, str]:
    """The ClusterKopfPeering's name and the one the operator pods are told to use."""
    (made,) = re.findall(r"kind: ClusterKopfPeering\nmetadata:\n  name: (\S+)", rendered)
    (told,) = re.findall(r"TANDEM_OPERATOR_PEERING_NAME\n\s+value: \"(\S+)\"", rendered)
    return made, told


@pytest.mark.parametrize(
    ("owner", "name"),
    [
        (None, f"{RELEASE}-operator-{NAMESPACE}"),  # a first install
        (NAMESPACE, f"{RELEASE}-operator"),  # this release made it before: kept
        ("team-b", f"{RELEASE}-operator-{NAMESPACE}"),  # another namespace's release's
    ],
)
def test_a_cluster_scoped_operator_keeps_the_peering_it_made(helm, cluster, owner, name):
    # Cluster-scoped objects now carry the release's namespace (releases of one name in
    # two namespaces collided); an upgrade that renamed the peering mid-rollout would
    # have the old and the new operator pods each leading their own, both acting.
    cluster.redis(None)
    old = f"{RELEASE}-operator"
    if cluster.api.read(PEERINGS, None, old) is not None:
        cluster.run(cluster.api.delete(PEERINGS, None, old))
    if owner is not None:
        annotations = {
            "meta.helm.sh/release-name": RELEASE,
            "meta.helm.sh/release-namespace": owner,
        }
        peering = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {
                "name": old,
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": annotations,
            },
        }
        cluster.run(cluster.api.create(PEERINGS, None, peering))
    result = _upgrade(helm, ["operator.scope=cluster"])
    assert result.returncode == 0, result.stderr
    assert _peering_names(result.stdout) == (name, name)


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_an_install_before_the_crds_chart_says_to_install_the_crds(helm, tmp_path, scope):
    # Cluster-scoped, the peering's lookup failed inside a helper with a discovery error
    # that named no CRD.
    kopf = (PEERINGS, kmock.resource("kopf.dev", "v1", "kopfpeerings"))
    with _pointed_at(Cluster(without=kopf), tmp_path):
        result = _upgrade(helm, [f"operator.scope={scope}"])
    assert result.returncode != 0
    assert "ensure CRDs are installed first" in result.stderr, result.stderr


DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")


def _gateway(name: str, app_name: str) -> dict[str, Any]:
    """The gateway Deployment this release made, as the API server returns it."""
    labels = {
        "app.kubernetes.io/name": app_name,
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "gateway",
        "app.kubernetes.io/part-of": "tandem",
        "app.kubernetes.io/managed-by": "Helm",
    }
    selector = {k: v for k, v in labels.items() if k != "app.kubernetes.io/part-of"}
    selector.pop("app.kubernetes.io/managed-by")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": labels,
            "annotations": {
                "meta.helm.sh/release-name": RELEASE,
                "meta.helm.sh/release-namespace": NAMESPACE,
            },
        },
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": selector}},
        },
    }


@pytest.mark.parametrize(
    ("sets", "refused"),
    [
        ([], False),
        (["nameOverride=llm"], True),  # every object renamed: new, empty Redis volume
        (["fullnameOverride=tandem", "nameOverride=llm"], True),  # same names, new selectors
    ],
)
def test_an_upgrade_that_renames_the_releases_objects_is_refused(helm, cluster, sets, refused):
    cluster.redis(None)
    cluster.run(
        cluster.api.create(DEPLOYMENTS, NAMESPACE, _gateway(f"{RELEASE}-gateway", "tandem"))
    )
    try:
        result = _upgrade(helm, sets)
    finally:
        cluster.run(cluster.api.delete(DEPLOYMENTS, NAMESPACE, f"{RELEASE}-gateway"))
    if not refused:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0
    assert "this release's objects are named tandem-gateway (app.kubernetes.io/name tandem)" in (
        result.stderr
    )
    assert "Keep nameOverride and fullnameOverride as they were" in result.stderr
