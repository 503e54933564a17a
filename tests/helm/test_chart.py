"""The charts with the real helm: lint, golden renders, and every manifest valid for Kubernetes.

Each charts/tandem/ci/*-values.yaml is rendered with `helm template` and
compared with tests/helm/golden/<name>.yaml (generated passwords and keys
masked). After an intended change, regenerate and review the diff:

    TANDEM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/helm
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helm import (
    CHART,
    CI_VALUES,
    CRD_CHART,
    GENERATED,
    ROOT,
    masked,
    of_kind,
    render,
    run_helm,
)
from support.manifest_schemas import validate

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_GOLDEN = os.environ.get("TANDEM_UPDATE_GOLDEN") == "1"
IDS = [path.stem for path in CI_VALUES]


def test_every_scenario_has_a_ci_values_file():
    assert set(IDS) >= {
        "defaults-values",
        "external-redis-values",
        "namespace-scoped-values",
        "monitoring-values",
        "ingress-values",
    }


def test_helm_is_the_v4_static_binary(helm):
    result = run_helm(helm, "version", "--short")
    assert result.returncode == 0 and result.stdout.startswith("v4."), result.stdout


@pytest.mark.parametrize("values", CI_VALUES, ids=IDS)
def test_lint(helm, values):
    result = run_helm(helm, "lint", str(CHART), "--strict", "--values", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_crd_chart(helm):
    result = run_helm(helm, "lint", str(CRD_CHART), "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


def _dump(manifests: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(masked(manifests), sort_keys=False, width=100)


@pytest.mark.parametrize("name", IDS)
def test_render_matches_golden(renders, name):
    text = _dump(renders[name])
    golden = GOLDEN / f"{name}.yaml"
    if UPDATE_GOLDEN:
        golden.write_text(text)
    assert golden.exists(), f"no golden: TANDEM_UPDATE_GOLDEN=1 pytest {__file__}"
    expected = golden.read_text()
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True), text.splitlines(True), "golden", "rendered"
            )
        )
        pytest.fail(f"{name} differs from its golden (TANDEM_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_golden_without_a_values_file():
    assert {p.stem for p in GOLDEN.glob("*.yaml")} <= set(IDS)


def test_every_manifest_is_valid(renders):
    # Each distinct object once: most are the same in every scenario, and one
    # kubernetes-validate call costs ~0.15 s (it loads the release's definitions).
    unique = {json.dumps(m, sort_keys=True): m for ms in renders.values() for m in ms}
    for manifest in unique.values():
        validate(manifest)


def test_generated_secrets_are_random_and_marked(renders):
    secrets = [
        s
        for s in of_kind(renders["defaults-values"], "Secret")
        if GENERATED in s["metadata"].get("annotations", {})
    ]
    assert {s["metadata"]["annotations"][GENERATED] for s in secrets} == {"password", "api-key"}
    for secret in secrets:
        (value,) = secret["data"].values()
        assert len(value) >= 40, "a 32-character random value, base64-encoded"


# A label value: 63 characters at most, alphanumerics, '-', '_', '.', alphanumeric at both ends.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _label_values(manifests: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(object, key, value) of every label of every object and pod template."""
    found = []
    for manifest in manifests:
        where = f"{manifest['kind']}/{manifest['metadata']['name']}"
        blocks = [manifest["metadata"].get("labels") or {}]
        template = manifest.get("spec", {}).get("template", {})
        blocks.append(template.get("metadata", {}).get("labels") or {})
        found += [(where, k, str(v)) for block in blocks for k, v in block.items()]
    return found


def test_every_label_value_is_one_kubernetes_takes(renders):
    for manifests in renders.values():
        for where, key, value in _label_values(manifests):
            assert len(value) <= 63 and LABEL_VALUE.match(value), (where, key, value)


@pytest.mark.parametrize("chart", [CHART, CRD_CHART], ids=lambda c: c.name)
def test_a_chart_version_with_build_metadata_makes_valid_labels(helm, tmp_path, chart):
    # SemVer's "+build" is no label character: helm.sh/chart takes "_" for it.
    copy = tmp_path / chart.name
    shutil.copytree(chart, copy)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    meta["version"] = meta["appVersion"] = "0.1.1+build.5"
    (copy / "Chart.yaml").write_text(yaml.safe_dump(meta))
    labels = _label_values(render(helm, copy))
    assert labels
    for where, key, value in labels:
        assert LABEL_VALUE.match(value), (where, key, value)
    assert {v for _, k, v in labels if k == "helm.sh/chart"} == {f"{chart.name}-0.1.1_build.5"}


# ------------------------------------------------------------------ the CRD chart


def test_crd_chart_files_are_byte_copies_of_crds():
    sources = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    copies = {p.name: p.read_bytes() for p in (CRD_CHART / "files").glob("*.yaml")}
    assert copies == sources, "charts/tandem-crds/files/ is stale: run `make chart-crds`"


def test_crd_chart_renders_the_crds_kept_on_uninstall(helm):
    rendered = render(helm, CRD_CHART)
    sources = [
        crd
        for path in sorted((ROOT / "crds").glob("*.yaml"))
        for crd in yaml.safe_load_all(path.read_text())
        if crd
    ]
    by_name = {crd["metadata"]["name"]: crd for crd in rendered}
    assert sorted(by_name) == sorted(crd["metadata"]["name"] for crd in sources)
    for source in sources:
        crd = by_name[source["metadata"]["name"]]
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        # Same object as crds/ but for the chart's labels and annotations.
        assert {k: v for k, v in crd.items() if k != "metadata"} == {
            k: v for k, v in source.items() if k != "metadata"
        }
        validate(crd)


def test_crd_chart_can_let_the_crds_go(helm):
    for crd in render(helm, CRD_CHART, sets=["keepOnUninstall=false"]):
        assert "helm.sh/resource-policy" not in crd["metadata"].get("annotations", {})


def test_crd_chart_can_leave_kopf_peering_to_another_release(helm):
    names = {crd["metadata"]["name"] for crd in render(helm, CRD_CHART)}
    assert "kopfpeerings.kopf.dev" in names and "clusterkopfpeerings.kopf.dev" in names
    alone = [crd["metadata"]["name"] for crd in render(helm, CRD_CHART, sets=["kopfPeering=false"])]
    assert alone == ["modeldeployments.serving.tandem.dev"]


def test_chart_versions_follow_the_project(helm):
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    for chart in (CHART, CRD_CHART):
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        assert meta["apiVersion"] == "v2"
        assert meta["appVersion"] == version.group(1), f"{chart.name}: appVersion != pyproject"
