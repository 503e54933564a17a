"""The real helm binary (`make tools` puts it in .tools/bin) and the charts it renders."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from support.kube_version import K8S_VERSION
from support.tools import tool_path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
CRD_CHART = ROOT / "charts" / "tandem-crds"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "tandem"
NAMESPACE = "tandem-system"
# Marks values the chart generates (random passwords and keys): they differ on every render.
GENERATED = "serving.tandem.dev/generated"


def helm_path() -> str:
    return tool_path("helm", "npm")


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


def run_helm(helm: str, *args: str) -> HelmResult:
    done = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60, check=False)
    return HelmResult(done.returncode, done.stdout, done.stderr)


def template_args(chart: Path, values: Sequence[Path] = (), sets: Sequence[str] = ()) -> list[str]:
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE]
    args += ["--kube-version", f"{K8S_VERSION}.0"]
    for path in values:
        args += ["--values", str(path)]
    for assignment in sets:
        args += ["--set", assignment]
    return args


def render(
    helm: str, chart: Path = CHART, values: Sequence[Path] = (), sets: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """`helm template` of the chart: the manifests, in helm's order."""
    result = run_helm(helm, *template_args(chart, values, sets))
    if result.returncode != 0:
        raise AssertionError(f"helm template failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def masked(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifests with generated Secret values replaced by a placeholder (for goldens)."""
    out = []
    for manifest in manifests:
        annotations = manifest.get("metadata", {}).get("annotations") or {}
        if manifest.get("kind") == "Secret" and GENERATED in annotations:
            manifest = {**manifest, "data": dict.fromkeys(manifest["data"], "<generated>")}
        out.append(manifest)
    return out


def pod_specs(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload and bare Pod."""
    found = []
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            found.append((f"{kind}/{name}", manifest["spec"]["template"]["spec"]))
        elif kind == "Pod":
            found.append((f"{kind}/{name}", manifest["spec"]))
    return found


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def named(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [m for m in of_kind(manifests, kind) if m["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]
