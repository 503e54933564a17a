"""`tandem sim`: simulate a Tandem cluster with the real scheduler and autoscaler.

    tandem sim --model llama-70b --tp 4 --mode disaggregated --prefill 2 --decode 2 \\
        --rate 4 --duration 600 --input 4000 --output 250 --slo-ttft 1 --slo-tpot 0.05
    tandem sim --model llama-8b --deployment model.yaml --trace day.jsonl --json
    tandem sim --replicas 2 --max-replicas 8 --arrival bursty --cv 3 --plot out/

docs/simulator.md explains the model and its limits.
"""

from __future__ import annotations

import argparse
import json
import math

from tandem.outputs import cannot_write, check_dir, check_file, say, write_failed
from tandem.sim import deployment as deploy
from tandem.sim.arguments import check_args, check_deployment_args
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import CPU, device
from tandem.sim.model_shapes import model_shape
from tandem.sim.network import Network
from tandem.sim.report import document, text
from tandem.sim.summary import SLO, summarize
from tandem.sim.workload import LengthDist, synthesize
from tandem.trace import read_trace, write_trace

# Tensor parallelism a model needs by default: a 70B model's bf16 weights (141 GB)
# leave no KV room on one H200.
_DEFAULT_TP = {"llama-70b": 4}


def main(args: argparse.Namespace) -> int:
    check_args(args)
    # Before anything runs: a long simulation must not end on an unwritable path.
    if args.save_trace:
        check_file("--save-trace", args.save_trace)
    if args.plot:
        check_dir("--plot", args.plot)
    shape = model_shape(args.model)
    tp = args.tp if args.tp is not None else _DEFAULT_TP.get(shape.name, 1)
    deployment = _deployment(args, tp, shape.config.vocab_size)
    check_deployment_args(args, deployment.mode, deployment.autoscaled)
    requests = _workload(args, deployment)
    if args.save_trace:
        try:
            write_trace(args.save_trace, requests)
        except OSError as exc:  # nothing was simulated yet: a bad argument, as above
            raise ValueError(cannot_write("--save-trace", args.save_trace, exc)) from None
    config = ClusterConfig(
        deployment=deployment,
        device=device(args.device),
        shape=shape,
        network=Network(bandwidth=_positive("--network-gbps", args.network_gbps) * 1e9 / 8),
        startup_s=args.startup_s,
        until_s=args.until,
        max_time_s=args.max_time,
    )
    result = simulate(config, requests)
    summary = summarize(result, SLO(args.slo_ttft, args.slo_tpot))
    setup = {
        "model": shape.name,
        "device": config.device.name,
        "tp": tp,
        "mode": deployment.mode,
        "roles": {
            str(role): {
                "replicas": r.replicas,
                "min": r.policy.min_replicas,
                "max": r.policy.max_replicas,
                "dp": r.dp,
                "gpus_per_pod": r.gpus_per_pod,
            }
            for role, r in deployment.roles.items()
        },
        "workload": args.trace or f"{args.arrival} {args.rate}/s for {args.duration:g}s",
    }
    if args.json:
        say(json.dumps(document(summary, result, setup), indent=1))
    else:
        title = (
            f"tandem sim: {shape.name} on {config.device.name} (TP {tp}), {deployment.mode}, "
            f"{setup['workload']}"
        )
        say(text(summary, result, title))
    if args.plot:  # after the report: a failure here loses no result
        from tandem.sim.plots import run_plots

        try:
            paths = run_plots(result, summary.slo, args.plot)
        except OSError as exc:
            write_failed("--plot", args.plot, exc)
            return 1
        if not args.json:
            for path in paths:
                say(f"wrote {path}")
    return 0


def _deployment(args: argparse.Namespace, tp: int, vocab_size: int) -> deploy.Deployment:
    if args.deployment:
        on_gpu = device(args.device) is not CPU
        return deploy.from_yaml(args.deployment, tp=tp, vocab_size=vocab_size, on_gpu=on_gpu)
    engine = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": args.chunked_prefill,
        "prefill_attempt_interval": args.prefill_attempt_interval,
        "prefill_any_attempt_interval": args.prefill_any_attempt_interval,
        "data_parallel_size": args.dp,
        "vocab_size": vocab_size,
    }
    if args.mode == "normal":
        role = deploy.role_setup(
            "normal",
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            tp=tp,
            engine=engine,
        )
        return deploy.Deployment({role.role: role})
    roles = [
        deploy.role_setup(
            name,
            replicas=count,
            min_replicas=low,
            max_replicas=high,
            tp=tp,
            engine=engine,
        )
        for name, count, low, high in (
            ("prefill", args.prefill, args.prefill_min, args.prefill_max),
            ("decode", args.decode, args.decode_min, args.decode_max),
        )
    ]
    return deploy.Deployment({r.role: r for r in roles})


def _workload(args: argparse.Namespace, deployment: deploy.Deployment):
    if args.trace:
        return read_trace(args.trace)
    # A prompt must leave its first token room in the context (the engine's admission).
    context = max(r.engine.max_model_len for r in deployment.roles.values())
    requests = synthesize(
        rate=_positive("--rate", args.rate),
        duration_s=_positive("--duration", args.duration),
        input_len=LengthDist.parse(args.input, cap=context - 1, what="--input"),
        output_len=LengthDist.parse(args.output, cap=context, what="--output"),
        cv=1.0 if args.arrival == "poisson" else _positive("--cv", args.cv),
        seed=args.seed,
    )
    if not requests:  # as an empty trace is refused (and the trace it saved was)
        raise ValueError(
            f"--rate {args.rate:g} for --duration {args.duration:g} s draws no request "
            "(this --seed): raise either"
        )
    return requests


def _positive(flag: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{flag} must be a positive number, got {value!r}")
    return value
