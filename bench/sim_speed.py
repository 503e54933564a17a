"""How fast the simulator runs: one hour of a 64-GPU cluster, real scheduler on every step.

    .venv/bin/python bench/sim_speed.py [--rate 100] [--duration 3600] [--mode normal]

64 H200s as 16 pods of Llama-70B at TP 4 (Normal: 16 normal pods;
disaggregated: 8 prefill + 8 decode), chat requests (~1k in / 300 out,
Poisson). Prints wall time, engine steps and token-steps (a sequence's share
of a step: the unit of the scheduler's work) per wall second, and how long
the simulated hour would take at that speed. Baseline: the 10-minute target.
"""

from __future__ import annotations

import argparse
import time

from tandem.sim import deployment as deploy
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import H200
from tandem.sim.model_shapes import model_shape
from tandem.sim.summary import SLO, summarize
from tandem.sim.workload import LengthDist, synthesize

TARGET_S = 600.0
HOUR_S = 3600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s")
    parser.add_argument("--duration", type=float, default=HOUR_S, help="seconds of arrivals")
    parser.add_argument("--mode", choices=["normal", "disaggregated"], default="normal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "normal":
        deployment = deploy.normal(16, tp=4)
    else:
        deployment = deploy.disaggregated(8, 8, tp=4)
    try:
        requests = synthesize(
            rate=args.rate,
            duration_s=args.duration,
            input_len=LengthDist.parse("lognormal:1000:0.4", cap=8000),
            output_len=LengthDist.parse("lognormal:300:0.4", cap=2000),
            seed=args.seed,
        )
    except ValueError as exc:  # a bad --rate or --duration, named by the workload
        parser.error(str(exc))
    started = time.perf_counter()
    result = simulate(ClusterConfig(deployment, H200, model_shape("llama-70b")), requests)
    wall = time.perf_counter() - started
    summary = summarize(result, SLO(1.0, 0.05))
    hour = wall * HOUR_S / args.duration
    print(
        f"64 H200s ({args.mode}, 16 pods of TP 4), {args.rate:g} req/s chat for "
        f"{args.duration:g} s: {len(requests)} requests, {summary.finished} finished"
    )
    print(
        f"cluster output {summary.output_tokens_per_s:,.0f} tokens/s, TTFT p50 "
        f"{summary.ttft.p50 * 1e3:.0f} ms, TPOT p50 {summary.tpot.p50 * 1e3:.1f} ms"
    )
    print(
        f"wall {wall:.1f} s: {result.steps / wall:,.0f} engine steps/s, "
        f"{result.tokens / wall:,.0f} token-steps/s"
    )
    verdict = "met" if hour <= TARGET_S else "MISSED"
    print(f"one simulated hour at this load: {hour / 60:.1f} min (target 10 min: {verdict})")


if __name__ == "__main__":
    main()
