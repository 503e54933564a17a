"""What GitOps tools read of a ModelDeployment's status: Argo CD's health check from
docs/operator.md, run in Lua on statuses the operator writes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from lupa import LuaRuntime

from tandem.operator.pod_trouble import PodTrouble
from tandem.operator.role_name import RoleName
from tandem.operator.status import RoleCounts, refusal_status, valid_status

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operator.md"
KEY = "resource.customizations.health.serving.tandem.dev_ModelDeployment"
NOW = "2026-01-01T00:00:00Z"
META = {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 2}


def argo_health_check():
    """The documented check, as Argo CD runs it: a function of `obj`, returning hs."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    [script] = [yaml.safe_load(b)[KEY] for b in blocks if KEY in (yaml.safe_load(b) or {})]
    lua = LuaRuntime(unpack_returned_tuples=True)
    check = lua.eval(f"function(obj)\n{script}\nend")

    def health(status: dict | None) -> tuple[str, str]:
        model = {"metadata": dict(META), **({"status": status} if status else {})}
        hs = check(lua.table_from(model, recursive=True))
        return hs["status"], hs["message"]

    return health


def test_argo_cds_health_check_reads_the_phase_of_this_generation():
    health = argo_health_check()
    crash = PodTrouble("EngineCrashLoop", "engine exited")
    served = valid_status(META, {RoleName.NORMAL: RoleCounts(1, 1, 1)}, {}, NOW)
    assert health(served) == ("Healthy", "normal 1/1 ready")
    starting = valid_status(META, {RoleName.NORMAL: RoleCounts(2, 2, 1)}, {}, NOW)
    assert health(starting)[0] == "Progressing"
    crashing = valid_status(META, {RoleName.NORMAL: RoleCounts(1, 1, trouble=crash)}, {}, NOW)
    assert health(crashing)[0] == "Degraded"
    refused = refusal_status(META, "spec.normal.maxReplicas: too many", {}, NOW)
    assert health(refused) == ("Degraded", "spec.normal.maxReplicas: too many")
    # A status of the generation before an edit says nothing of the edit yet.
    assert health({**served, "observedGeneration": 1})[0] == "Progressing"
    assert health(None) == ("Progressing", "waiting for the operator")
