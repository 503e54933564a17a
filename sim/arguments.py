"""Command-line flags of `tandem sim` (kept light: `tandem --help` imports every
subcommand's flags, and these need only the preset names)."""

from __future__ import annotations

import argparse
import math

from tandem.sim.devices import device_names
from tandem.sim.model_shapes import model_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and hardware")
    model.add_argument("--model", default="llama-70b", help=f"one of {', '.join(model_names())}")
    model.add_argument(
        "--tp",
        type=int,
        default=None,
        help="GPUs per engine rank (default: 4 for llama-70b, else 1)",
    )
    model.add_argument("--device", default="h200", help=f"one of {', '.join(device_names())}")
    model.add_argument(
        "--network-gbps", type=float, default=400.0, help="KV transfer link per GPU, Gb/s"
    )

    dep = parser.add_argument_group("deployment (or --deployment model.yaml)")
    dep.add_argument("--deployment", default=None, help="a ModelDeployment YAML")
    dep.add_argument("--mode", choices=["normal", "disaggregated"], default="normal")
    dep.add_argument("--replicas", type=int, default=1, help="normal pods at the start")
    dep.add_argument("--min-replicas", type=int, default=None)
    dep.add_argument("--max-replicas", type=int, default=None)
    dep.add_argument("--prefill", type=int, default=1, help="prefill pods at the start")
    dep.add_argument("--prefill-min", type=int, default=None)
    dep.add_argument("--prefill-max", type=int, default=None)
    dep.add_argument("--decode", type=int, default=1, help="decode pods at the start")
    dep.add_argument("--decode-min", type=int, default=None)
    dep.add_argument("--decode-max", type=int, default=None)
    dep.add_argument("--dp", type=int, default=1, help="data-parallel ranks per pod")
    dep.add_argument("--max-model-len", type=int, default=8192)
    dep.add_argument("--max-num-seqs", type=int, default=256)
    dep.add_argument("--max-num-batched-tokens", type=int, default=None)
    dep.add_argument("--chunked-prefill", action="store_true")
    dep.add_argument("--prefill-attempt-interval", type=int, default=70)
    dep.add_argument("--prefill-any-attempt-interval", type=int, default=100)
    dep.add_argument("--startup-s", type=float, default=120.0, help="scale-up to ready, seconds")

    load = parser.add_argument_group("workload (a trace, or distributions)")
    load.add_argument("--trace", default=None, help="JSONL: arrival_s, input_tokens, output_tokens")
    load.add_argument("--rate", type=float, default=2.0, help="requests/s")
    load.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    load.add_argument("--arrival", choices=["poisson", "bursty"], default="poisson")
    load.add_argument(
        "--cv", type=float, default=3.0, help="bursty: coefficient of variation of gaps"
    )
    load.add_argument(
        "--input", default="lognormal:1000:0.5", help="N, uniform:LO:HI, lognormal:MEAN:SIGMA"
    )
    load.add_argument("--output", default="lognormal:300:0.5")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--save-trace", default=None, help="write the workload as a JSONL trace")

    out = parser.add_argument_group("objectives and output")
    out.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    out.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    out.add_argument("--until", type=float, default=None, help="simulate at least this long (s)")
    out.add_argument("--max-time", type=float, default=math.inf, help="stop here (s)")
    out.add_argument("--json", action="store_true", help="print a JSON document, not text")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
