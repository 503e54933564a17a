"""What restarts the chart's pods: a new Redis password or URL does, in Redis and in its
clients together (checksum/redis-auth); a chart bump alone does not (no version labels on
pod templates), and neither does a render without a cluster (GitOps)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helm import CHART, GENERATED, ROOT, named, of_kind, render

CHECKSUM = "checksum/redis-auth"
REDIS = ("StatefulSet", "tandem-redis")
CLIENTS = (("Deployment", "tandem-gateway"), ("Deployment", "tandem-operator"))


def _checksums(manifests: list[dict[str, Any]]) -> dict[str, str]:
    """Workload name -> its pod template's checksum/redis-auth (every workload has one)."""
    found = {}
    for manifest in manifests:
        if manifest["kind"] in ("Deployment", "StatefulSet"):
            annotations = manifest["spec"]["template"]["metadata"].get("annotations") or {}
            found[manifest["metadata"]["name"]] = annotations[CHECKSUM]
    return found


@pytest.mark.parametrize(
    "variants",
    [
        # The chart's Redis: a password, another one, a Secret of the user's, a generated one.
        [["redis.auth.password=a"], ["redis.auth.password=b"], ["redis.auth.existingSecret=s"], []],
        # An external Redis: its URL, another one, a Secret of the user's.
        [
            ["redis.enabled=false", "redis.external.url=redis://a.db.svc:6379/0"],
            ["redis.enabled=false", "redis.external.url=redis://b.db.svc:6379/0"],
            ["redis.enabled=false", "redis.external.existingSecret=s"],
        ],
    ],
    ids=["internal", "external"],
)
def test_a_new_redis_password_or_url_restarts_redis_and_its_clients(helm, variants):
    seen = []
    for sets in variants:
        checksums = _checksums(render(helm, sets=sets))
        expected = {name for _, name in CLIENTS}
        if "redis.enabled=false" not in sets:
            expected.add(REDIS[1])
        assert set(checksums) == expected, sets
        (checksum,) = set(checksums.values())  # all of them together: one password
        seen.append(checksum)
    assert len(set(seen)) == len(variants), "a change that restarts nothing"


def test_values_that_do_not_decide_the_password_restart_nothing(helm):
    # An external URL left over while the chart runs Redis decides nothing.
    before = _checksums(render(helm))
    after = _checksums(render(helm, sets=["redis.external.url=redis://elsewhere.db.svc:6379/0"]))
    assert before == after


def test_a_generated_password_keeps_its_checksum_across_renders(helm):
    # Without a cluster (helm template, Argo CD) the generated password is new at every
    # render; a checksum of it would restart every pod at every sync. docs/guide.md
    # ("Under GitOps") tells to set the password there.
    first, second = render(helm), render(helm)

    def password(manifests: list[dict[str, Any]]) -> str:
        (secret,) = [
            s for s in of_kind(manifests, "Secret") if s["metadata"]["name"] == "tandem-redis"
        ]
        assert secret["metadata"]["annotations"][GENERATED] == "password"
        return secret["data"]["password"]

    assert password(first) != password(second)
    assert _checksums(first) == _checksums(second)


def _pod_labels(manifest: dict[str, Any]) -> dict[str, str]:
    return manifest["spec"]["template"]["metadata"]["labels"]


def test_pod_templates_carry_no_version_labels_and_selectors_stay(renders):
    for name, manifests in renders.items():
        for manifest in manifests:
            if manifest["kind"] not in ("Deployment", "StatefulSet"):
                continue
            where = f"{name}: {manifest['metadata']['name']}"
            labels = _pod_labels(manifest)
            assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(labels), where
            assert "helm.sh/chart" in manifest["metadata"]["labels"], where  # the object's
            selector = manifest["spec"]["selector"]["matchLabels"]
            assert set(selector) == {
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/component",
            }, where
            assert selector.items() <= labels.items(), where


def test_a_chart_bump_leaves_redis_alone(helm, tmp_path: Path):
    # Redis is one pod: a changed pod template restarts it, and the API is down meanwhile.
    bumped = tmp_path / "tandem"
    shutil.copytree(CHART, bumped)
    meta = yaml.safe_load((bumped / "Chart.yaml").read_text())
    meta["version"], meta["appVersion"] = "9.9.9", "9.9.9"
    (bumped / "Chart.yaml").write_text(yaml.safe_dump(meta))
    old, new = render(helm), render(helm, bumped)
    assert named(old, *REDIS)["spec"]["template"] == named(new, *REDIS)["spec"]["template"]
    assert named(new, *REDIS)["metadata"]["labels"]["helm.sh/chart"] == "tandem-9.9.9"
    # The gateway and the operator roll with their new image, not with a label alone.
    sets = ["gateway.image.tag=v1", "operator.image.tag=v1", "operator.engineImage.tag=v1"]
    old, new = render(helm, sets=sets), render(helm, bumped, sets=sets)
    for kind, name in CLIENTS:
        before, after = named(old, kind, name), named(new, kind, name)
        assert before["spec"]["template"] == after["spec"]["template"], name


def test_the_guide_says_to_set_generated_values_under_gitops():
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## Under GitOps", 1)[1].split("\n## ", 1)[0]
    for needed in (
        "Argo CD",
        "helm template",
        "redis.auth.existingSecret",
        "redis.auth.password",
        "gateway.auth.bootstrapKey=false",
    ):
        assert needed in section, needed
    lines = (CHART / "values.yaml").read_text().splitlines()
    for key in ("    password:", "    bootstrapKey:"):  # redis.auth's, gateway.auth's
        (at,) = [i for i, line in enumerate(lines) if line.startswith(key)]
        comment = []
        while lines[at - 1].lstrip().startswith("#"):
            at -= 1
            comment.append(lines[at])
        assert "Argo CD" in " ".join(comment), f"values.yaml: no GitOps note above {key}"
