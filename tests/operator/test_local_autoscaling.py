"""`tandem up -f` end to end: a burst raises a role's replicas, they come back down,
and no request fails during either change. Real Redis, gateway and engines."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.stacks import running_stack

from tandem.redis_server import free_port
from tandem.up import UpConfig

pytestmark = pytest.mark.timeout(300)

MANIFEST = {
    "apiVersion": "serving.tandem.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "burst"},
    "spec": {
        "model": {"path": "random:tiny", "servedModelName": "tiny"},
        # A small KV pool (512 tokens per engine): a burst fills it quickly.
        "engine": {"maxModelLen": 256, "kvCacheMemory": "1Mi", "dtype": "float32"},
        "mode": "Disaggregated",
        "prefill": {"minReplicas": 1, "maxReplicas": 2, "scaleDownStabilizationSeconds": 4},
        "decode": {
            "minReplicas": 1,
            "maxReplicas": 3,
            "targetKVCacheUsage": 0.3,
            "scaleDownStabilizationSeconds": 4,
        },
    },
}


@pytest.fixture
def stack(tmp_path):
    config = UpConfig(manifest=MANIFEST, port=free_port(), log_dir=tmp_path, scale_every=1.0)
    with running_stack(config) as stack:
        yield stack


def _ask(stack, i):
    body = {
        "model": "tiny",
        "prompt": [(i * 13 + j) % 500 for j in range(60)],
        "max_tokens": 160,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    finish = None
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=240
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
    return finish


def test_a_burst_scales_decode_up_and_back_down_without_failures(stack):
    actuator = stack.actuator
    peak = dict(actuator.replicas)
    finishes = []
    # Bursts until decode scales up: on a fast machine one burst can end (~2 s) between
    # two evaluations, which see only what the engines hold when they scrape.
    give_up = time.monotonic() + 120
    with ThreadPoolExecutor(16) as pool:
        while peak["decode"] == 1 and time.monotonic() < give_up:
            futures = [pool.submit(_ask, stack, i) for i in range(16)]
            while not all(f.done() for f in futures):
                for role, n in actuator.replicas.items():
                    peak[role] = max(peak[role], n)
                time.sleep(0.2)
            finishes += [f.result() for f in futures]
    # Every request answered to its end (EOS or max_tokens), none with an error.
    assert all(f in ("stop", "length") for f in finishes), finishes
    assert peak["decode"] > 1, f"decode never scaled up: {actuator.decisions}"
    deadline = time.monotonic() + 60
    while actuator.replicas["decode"] > 1 or actuator.replicas["prefill"] > 1:
        assert time.monotonic() < deadline, f"never scaled back down: {actuator.replicas}"
        time.sleep(0.5)
    reasons = [d.reason for d in actuator.decisions]
    assert any(d.replicas > d.current for d in actuator.decisions), reasons
    assert any(d.replicas < d.current for d in actuator.decisions), reasons
