"""Command-line flags of `tandem sim` and the checks between them (kept light: `tandem
--help` imports every subcommand's flags, and these need only the preset names)."""

from __future__ import annotations

import argparse
import math

from tandem.sim.devices import device_names
from tandem.sim.model_shapes import model_names

# The flags that set each role's pods: at the start, fewest, most.
REPLICA_FLAGS = {
    "normal": ("--replicas", "--min-replicas", "--max-replicas"),
    "prefill": ("--prefill", "--prefill-min", "--prefill-max"),
    "decode": ("--decode", "--decode-min", "--decode-max"),
}
_MODE_FLAGS = {
    "normal": REPLICA_FLAGS["normal"],
    "disaggregated": REPLICA_FLAGS["prefill"] + REPLICA_FLAGS["decode"],
}
# What a --deployment YAML sets instead: the mode, the roles' pods and their engines.
_DEPLOYMENT_FLAGS = (
    "--mode",
    *_MODE_FLAGS["normal"],
    *_MODE_FLAGS["disaggregated"],
    "--dp",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--chunked-prefill",
    "--prefill-attempt-interval",
    "--prefill-any-attempt-interval",
)
# What a --trace sets instead: arrivals and lengths.
_WORKLOAD_FLAGS = ("--rate", "--duration", "--arrival", "--cv", "--input", "--output", "--seed")


class _Noted(argparse.Action):
    """Stores the flag's value and notes the flag as given, so that check_args can
    tell a flag left at its default from one given with the default's value."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.given_flags = (*namespace.given_flags, self.option_strings[0])


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags that this run would ignore, and bad objectives before a long run:
    ValueError naming the flags."""
    given = args.given_flags
    if args.deployment and "--model" not in given:
        # A manifest names a checkpoint, not one of the simulator's shapes: the default's
        # llama-70b on 4 GPUs a pod answered for a manifest of another model.
        raise ValueError(
            f"--deployment needs --model, the simulated shape of its model (one of "
            f"{', '.join(model_names())})"
        )
    if args.deployment:
        _refuse(
            given,
            _DEPLOYMENT_FLAGS,
            "not with --deployment (the ModelDeployment sets the mode, the roles' replicas "
            "and their engines)",
        )
    else:
        other = "disaggregated" if args.mode == "normal" else "normal"
        default = "" if "--mode" in given else " (the default)"
        _refuse(
            given,
            _MODE_FLAGS[other],
            f"only with --mode {other}; this run is --mode {args.mode}{default}: its pods "
            f"are set by {', '.join(_MODE_FLAGS[args.mode])}",
        )
    if args.trace:
        _refuse(given, _WORKLOAD_FLAGS, "not with --trace (the trace sets arrivals and lengths)")
    elif args.arrival == "poisson":
        _refuse(given, ("--cv",), "only with --arrival bursty (Poisson arrivals have a cv of 1)")
    from tandem.sim.summary import SLO  # numpy: not for `tandem --help`

    SLO(args.slo_ttft, args.slo_tpot)


def check_deployment_args(args: argparse.Namespace, mode: str, autoscaled: bool) -> None:
    """Refuse the flags the deployment (its mode, its bounds: flags or --deployment)
    leaves without effect: ValueError naming them."""
    if mode != "disaggregated":
        _refuse(args.given_flags, ("--network-gbps",), "only for a disaggregated deployment")
    else:  # prompt and completion engines never vote on a prefill attempt
        attempts = ("--prefill-attempt-interval", "--prefill-any-attempt-interval")
        _refuse(args.given_flags, attempts, "only for a normal deployment (its engines' votes)")
    if not autoscaled:
        why = "only where some role is autoscaled (min below max): no pod starts mid-run"
        _refuse(args.given_flags, ("--startup-s",), why)


def _refuse(given: tuple[str, ...], flags: tuple[str, ...], why: str) -> None:
    wrong = [f for f in dict.fromkeys(given) if f in flags]  # once each, in the order given
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: {why}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(given_flags=())  # _Noted adds to it
    model = parser.add_argument_group("model and hardware")
    model.add_argument(
        "--model",
        action=_Noted,
        default="llama-70b",
        help=f"one of {', '.join(model_names())} (default: %(default)s; needed with --deployment)",
    )
    model.add_argument(
        "--tp",
        type=int,
        default=None,
        help="GPUs per engine rank (default: 4 for llama-70b, else 1)",
    )
    model.add_argument("--device", default="h200", help=f"one of {', '.join(device_names())}")
    model.add_argument(
        "--network-gbps",
        action=_Noted,
        type=float,
        default=400.0,
        help="KV transfer link per GPU, Gb/s (disaggregated)",
    )

    dep = parser.add_argument_group("deployment (or --deployment model.yaml)")
    dep.add_argument("--deployment", default=None, help="a ModelDeployment YAML")
    dep.add_argument("--mode", action=_Noted, choices=["normal", "disaggregated"], default="normal")
    dep.add_argument(
        "--replicas", action=_Noted, type=int, default=1, help="normal pods at the start"
    )
    dep.add_argument("--min-replicas", action=_Noted, type=int, default=None)
    dep.add_argument("--max-replicas", action=_Noted, type=int, default=None)
    dep.add_argument(
        "--prefill", action=_Noted, type=int, default=1, help="prefill pods at the start"
    )
    dep.add_argument("--prefill-min", action=_Noted, type=int, default=None)
    dep.add_argument("--prefill-max", action=_Noted, type=int, default=None)
    dep.add_argument(
        "--decode", action=_Noted, type=int, default=1, help="decode pods at the start"
    )
    dep.add_argument("--decode-min", action=_Noted, type=int, default=None)
    dep.add_argument("--decode-max", action=_Noted, type=int, default=None)
    dep.add_argument("--dp", action=_Noted, type=int, default=1, help="data-parallel ranks per pod")
    dep.add_argument("--max-model-len", action=_Noted, type=int, default=8192)
    dep.add_argument("--max-num-seqs", action=_Noted, type=int, default=256)
    dep.add_argument("--max-num-batched-tokens", action=_Noted, type=int, default=None)
    dep.add_argument("--chunked-prefill", action=_Noted, nargs=0, const=True, default=False)
    dep.add_argument("--prefill-attempt-interval", action=_Noted, type=int, default=70)
    dep.add_argument("--prefill-any-attempt-interval", action=_Noted, type=int, default=100)
    dep.add_argument(
        "--startup-s",
        action=_Noted,
        type=float,
        default=120.0,
        help="scale-up to ready, seconds (autoscaled roles)",
    )

    load = parser.add_argument_group("workload (a trace, or distributions)")
    load.add_argument("--trace", default=None, help="JSONL: arrival_s, input_tokens, output_tokens")
    load.add_argument("--rate", action=_Noted, type=float, default=2.0, help="requests/s")
    load.add_argument(
        "--duration", action=_Noted, type=float, default=300.0, help="seconds of arrivals"
    )
    load.add_argument("--arrival", action=_Noted, choices=["poisson", "bursty"], default="poisson")
    load.add_argument(
        "--cv",
        action=_Noted,
        type=float,
        default=3.0,
        help="bursty: coefficient of variation of the gaps, at most 10",
    )
    load.add_argument(
        "--input",
        action=_Noted,
        default="lognormal:1000:0.5",
        help="tokens: N, uniform:LOW:HIGH, normal:MEAN:STD[:MIN:MAX] or "
        "lognormal:MEAN:SIGMA[:MIN:MAX] (docs/simulator.md)",
    )
    load.add_argument(
        "--output", action=_Noted, default="lognormal:300:0.5", help="tokens: as --input"
    )
    load.add_argument("--seed", action=_Noted, type=int, default=0)
    load.add_argument("--save-trace", default=None, help="write the workload as a JSONL trace")

    out = parser.add_argument_group("objectives and output")
    out.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    out.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    out.add_argument("--until", type=float, default=None, help="simulate at least this long (s)")
    out.add_argument("--max-time", type=float, default=math.inf, help="stop here (s)")
    out.add_argument("--json", action="store_true", help="print a JSON document, not text")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
