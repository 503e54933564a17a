"""On the CPU an engine keeps freed heap memory: each prefill reuses the last one's
pages instead of faulting fresh, zeroed ones in (engine/host_memory.py).

mallopt is process-wide and one-way, so each case runs in its own interpreter.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the thresholds it sets are glibc malloc's"
)

# Page faults of six 1,536-token prefills on random:medium, whose activations
# (~19 MiB for gate/up) sit where glibc's default thresholds keep mapping and
# unmapping them. "default" stops the engine from changing those thresholds.
SCRIPT = textwrap.dedent(
    """
    import json, random, resource, sys
    import tandem.engine.llm as llm_module
    from tandem.engine import LLM, SamplingParams

    if sys.argv[1] == "default":
        llm_module.keep_freed_memory = lambda: False
    llm = LLM("random:medium", max_model_len=2048, num_kv_blocks=128)
    rng = random.Random(0)
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        prompt = [rng.randrange(1000) for _ in range(1536)]
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
    """
)


def prefill_faults(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_an_engine_on_the_cpu_reuses_its_activation_pages() -> None:
    # The first prefills grow the heap (glibc may still place a block anew now and
    # then: one run saw 1,538 faults in its third); by the fourth the pages are reused.
    # The baseline, without the change, faults ~10,000 pages in at every prefill.
    default, keep = prefill_faults("default")[3:], prefill_faults("keep")[3:]
    assert sum(default) > 5_000  # so the comparison below can fail
    assert sum(keep) < sum(default) / 10
