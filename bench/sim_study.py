"""The simulator's studies (docs/simulator.md): tables on stdout, plots under --out.

    .venv/bin/python bench/sim_study.py disagg      # Normal vs Disaggregated, 70B, 16 H200s
    .venv/bin/python bench/sim_study.py intervals   # ALL / ANY prefill intervals, 4 DP ranks
    .venv/bin/python bench/sim_study.py autoscale   # a bursty day: autoscaler (scale-up
                                                    # windows 0, 30, 60 s) vs fixed peak

Every run is seeded: the same command prints the same tables (the wall times
in the progress lines aside). The plot goes to --out, by default docs/img/, where
it replaces the figure docs/simulator.md shows: that is how those figures are made.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tandem.sim import study_autoscale, study_disagg, study_intervals

# The docs' figures: a run without --out redraws them.
IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def disagg(args: argparse.Namespace) -> None:
    results = []
    for workload in study_disagg.WORKLOADS:
        runs = study_disagg.sweep(workload, args.duration, args.seed, log=_log)
        results.append((workload, runs))
        print(study_disagg.table(workload, runs), "\n", flush=True)
    study_disagg.plot(results, str(args.out / "sim-disagg.png"))


def intervals(args: argparse.Namespace) -> None:
    by_rate = {}
    for rate in study_intervals.RATES if args.rate is None else (args.rate,):
        runs = study_intervals.sweep(rate, args.duration, args.seed, log=_log)
        print(study_intervals.table(runs, rate), "\n", flush=True)
        by_rate[rate] = runs
    study_intervals.plot(by_rate, str(args.out / "sim-intervals.png"))


def autoscale(args: argparse.Namespace) -> None:
    rate = 3.0 if args.rate is None else args.rate
    requests = study_autoscale.trace(rate, args.seed, args.duration)
    _log(f"  day trace: {len(requests)} requests")
    windows = [float(w) for w in args.scale_up_windows.split(",")]
    runs = study_autoscale.run_study(requests, until_s=args.duration, up_windows=windows, log=_log)
    print(study_autoscale.table(runs))
    print(study_autoscale.summary_line(runs))
    study_autoscale.plot(requests, runs, str(args.out / "sim-autoscale.png"))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


WINDOWS = "0,30,60"  # --scale-up-windows' default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=["disagg", "intervals", "autoscale"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (mean)")
    parser.add_argument(
        "--scale-up-windows",
        default=WINDOWS,
        help="autoscale: scaleUpStabilizationSeconds of each autoscaled run, comma-separated",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=IMG,
        help="folder for the plot (default: docs/img, overwriting the docs' figure)",
    )
    args = parser.parse_args()
    for flag, value in (("--duration", args.duration), ("--rate", args.rate)):
        if value is not None and not 0 < value < float("inf"):
            parser.error(f"{flag} must be a finite number > 0, got {value:g}")
    # Flags a study does not use are refused, not ignored (disagg sweeps its own rates).
    if args.study == "disagg" and args.rate is not None:
        parser.error("--rate: the disagg study sweeps its own rates; it takes none")
    if args.study != "autoscale" and args.scale_up_windows != WINDOWS:
        parser.error(f"--scale-up-windows: only the autoscale study takes it, not {args.study}")
    if args.duration is None:  # a day for the autoscaler; each disagg / intervals run 120 s
        args.duration = study_autoscale.DAY_S if args.study == "autoscale" else 120.0
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    {"disagg": disagg, "intervals": intervals, "autoscale": autoscale}[args.study](args)
    _log(f"took {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
