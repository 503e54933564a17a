"""Scheduler overhead: microseconds per schedule() + update() at 256 sequences.

    python bench/scheduler_overhead.py [--steps 400]

Baseline: the 500 us per step target (under 1 % of a batch-64 decode step of
a 135M model on a 2-core CPU). The runner is a stand-in whose result is built
outside the timed region: only the scheduler's own work is measured.
Figures are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from counts import count  # bench/ is on sys.path when run as a script

from tandem.engine.config import EngineConfig
from tandem.engine.plan import StepPlan, StepResult
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler

TARGET_US = 500.0
VOCAB = 49152
LONG = SamplingParams(max_tokens=1_000_000, ignore_eos=True)


def _result(plan: StepPlan, drafts: int) -> StepResult:
    sampled, proposed = {}, {}
    for seq in plan.seqs:
        if not seq.sample:
            continue
        # Accept about half the drafts (the seed reports 3.2-4.4 of 5 in production).
        accepted = seq.draft_token_ids[: len(seq.draft_token_ids) // 2]
        sampled[seq.request_id] = [*accepted, 1 + seq.start_pos % 1000]
        if drafts:
            proposed[seq.request_id] = [11, 12, 13, 14, 15][:drafts]
    return StepResult(sampled, proposed if drafts else None)


def _timed_steps(sched: Scheduler, steps: int, drafts: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        result = _result(plan, drafts)
        t2 = time.perf_counter()
        sched.update(plan, result)
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
    return times


def _running(num_seqs: int, drafts: int, prompt_len: int = 512) -> Scheduler:
    config = EngineConfig(max_model_len=8192, num_speculative_tokens=drafts, vocab_size=VOCAB)
    sched = Scheduler(config, num_blocks=256 * 8192 // 16)
    for i in range(num_seqs):
        prompt = [(i * 31 + j) % VOCAB for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, LONG))
    while sched.waiting:
        plan = sched.schedule()
        sched.update(plan, _result(plan, drafts))
    return sched


def decode_case(steps: int, drafts: int) -> float:
    sched = _running(256, drafts)
    _timed_steps(sched, 20, drafts)  # warm up
    return statistics.median(_timed_steps(sched, steps, drafts))


def mixed_prefill_case(rounds: int) -> float:
    """128 running sequences, then a prompt step admitting 64 prompts of 64 tokens
    (half of them sharing a cached 48-token prefix)."""
    sched = _running(128, 0)
    shared = [7] * 48
    times = []
    for k in range(rounds):
        for i in range(64):
            tail = [(k * 64 + i + j) % VOCAB for j in range(16)]
            head = shared if i % 2 else [(k + i + j) % VOCAB for j in range(48)]
            sched.add_request(Request(f"p{k}-{i}", head + tail, LONG))
        sched.decode_step = 0  # an attempt point
        sched.prompt_steps_in_a_row = 0  # (the warm-up's prompt steps reached the cap)
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        result = _result(plan, 0)
        t2 = time.perf_counter()
        sched.update(plan, result)
        t3 = time.perf_counter()
        if not (plan.is_prefill and len(plan.seqs) == 64):
            raise RuntimeError("the prompt step did not admit all 64 prompts")
        times.append((t1 - t0) + (t3 - t2))
        for i in range(64):
            sched.abort_request(f"p{k}-{i}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=count, default=400)
    args = parser.parse_args()
    gc.collect()
    rows = [
        ("decode, 256 seqs, no drafts", decode_case(args.steps, 0)),
        ("decode, 256 seqs, 5 drafts", decode_case(args.steps, 5)),
        ("prompt step, 64 new + 128 running", mixed_prefill_case(max(args.steps // 10, 20))),
    ]
    print(f"{'case':<36} {'us/step':>9} {'target':>8} {'ratio':>7}")
    for name, seconds in rows:
        us = seconds * 1e6
        print(f"{name:<36} {us:>9.0f} {TARGET_US:>8.0f} {us / TARGET_US:>6.2f}x")
    print("ratio = measured / target (below 1.00x meets the target); median of the steps")


if __name__ == "__main__":
    main()
