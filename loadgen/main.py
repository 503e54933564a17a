"""`tandem bench`: load an OpenAI-compatible endpoint, report throughput, latency and goodput.

Works against Tandem (`tandem up`, a cluster's gateway) or any server with
the OpenAI streaming API (vLLM, ...). See docs/bench-client.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tandem.loadgen.client import Target, probe_prompt_tokens
from tandem.loadgen.lengths import parse_length
from tandem.loadgen.progress import Progress, progress_enabled
from tandem.loadgen.prompts import (
    Calibration,
    fit_calibration,
    request_rng,
    token_ids,
    words,
)
from tandem.loadgen.replicas import (
    GatewayMetricsSource,
    RegistrySource,
    ReplicaPoller,
    metrics_url,
)
from tandem.loadgen.report import Slo, build_report, format_report
from tandem.loadgen.runner import RunLimits, RunResult, run
from tandem.loadgen.workload import synthetic_workload, trace_workload
from tandem.trace import read_trace

DEFAULT_REQUESTS = 100
# Word counts of the two calibration probes of --prompt text.
CALIBRATION_WORDS = (50, 200)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000/v1", help="base URL (…/v1)")
    target.add_argument("--model", default=None, help="default: the only one /v1/models lists")
    target.add_argument(
        "--api-key",
        default=None,
        help="default: $TANDEM_API_KEY, else $OPENAI_API_KEY, else none sent",
    )
    target.add_argument("--api", choices=["completions", "chat"], default="completions")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    load = parser.add_argument_group("load")
    load.add_argument(
        "-n", "--num-requests", type=int, default=None, help=f"default {DEFAULT_REQUESTS}"
    )
    load.add_argument("--duration", type=float, default=None, help="seconds of sending")
    load.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 bursty"
    )
    load.add_argument("--concurrency", type=int, default=64, help="in flight at most; 0: no cap")
    load.add_argument("--input-tokens", default="128", help="length spec (docs/bench-client.md)")
    load.add_argument("--output-tokens", default="64", help="length spec")
    load.add_argument("--trace", default=None, help="JSONL trace: arrivals and lengths")
    load.add_argument("--trace-time-scale", type=float, default=1.0, help="0.5: replay 2x faster")
    load.add_argument("--seed", type=int, default=0)
    prompt = parser.add_argument_group("requests")
    prompt.add_argument(
        "--prompt", choices=["ids", "text"], default=None, help="ids (completions default) or text"
    )
    prompt.add_argument("--token-id-range", default="10:499", help="LOW:HIGH of --prompt ids")
    prompt.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers refusing it)"
    )
    prompt.add_argument("--temperature", type=float, default=0.0)
    out = parser.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=None)
    out.add_argument("--slo-tpot-ms", type=float, default=None)
    out.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    out.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    tandem = parser.add_argument_group(
        "Tandem replicas (from the gateway's /metrics, or the engine registry in Redis)"
    )
    tandem.add_argument(
        "--redis-url", default=None, help="read replicas from the deployment's Redis instead"
    )
    tandem.add_argument("--key-prefix", default="tandem")
    tandem.add_argument("--replica-poll-s", type=float, default=1.0)


def main(args: argparse.Namespace) -> int:
    """Run the bench; 0 when at least one request succeeded, 1 when none did."""
    limits, workload, slo = _plan(args)
    target = _target(args)
    prompt_mode = args.prompt or ("text" if args.api == "chat" else "ids")
    if prompt_mode == "ids" and args.api == "chat":
        raise ValueError("--prompt ids needs --api completions (chat messages are text)")
    id_range = _id_range(args.token_id_range) if prompt_mode == "ids" else None
    progress = Progress(sys.stderr, progress_enabled(sys.stderr, args.quiet))
    result, target = asyncio.run(_bench(args, target, workload, limits, id_range, progress))
    config = _config(args, target, limits, prompt_mode)
    report = build_report(result, slo, config)
    if args.json:  # first: the machine-readable result survives a closed stdout
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(format_report(report))
    if args.plots:
        from tandem.loadgen.plots import write_plots

        for path in write_plots(result, Path(args.plots), title=f"({target.model})"):
            print(f"plot         {path}")
    return 0 if report["requests"]["ok"] else 1


def _plan(args: argparse.Namespace) -> tuple[RunLimits, Any, Slo]:
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.duration is not None and not args.duration > 0:
        raise ValueError(f"--duration must be > 0 s, got {args.duration}")
    if args.concurrency < 0:
        raise ValueError(f"--concurrency must be >= 0 (0: no cap), got {args.concurrency}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 s, got {args.timeout}")
    if not args.replica_poll_s > 0:
        raise ValueError(f"--replica-poll-s must be > 0, got {args.replica_poll_s}")
    concurrency = args.concurrency or None
    num = args.num_requests
    if args.trace:
        trace = read_trace(args.trace)
        num = len(trace) if num is None else min(num, len(trace))
        workload = trace_workload(trace, args.trace_time_scale)
    else:
        inputs = parse_length(args.input_tokens, "--input-tokens")
        outputs = parse_length(args.output_tokens, "--output-tokens")
        workload = synthetic_workload(args.rate, args.burstiness, inputs, outputs, args.seed)
        if num is None and args.duration is None:
            num = DEFAULT_REQUESTS
        if num is None and math.isinf(args.rate) and concurrency is None:
            raise ValueError("--rate inf with --duration needs a --concurrency cap")
    return RunLimits(num, args.duration, concurrency), workload, slo


def _target(args: argparse.Namespace) -> Target:
    url = args.url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url must be an http(s) URL, got {args.url!r}")
    if parts.path in ("", "/"):
        url += "/v1"  # a bare host: the OpenAI API lives under /v1
    key = args.api_key or os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return Target(
        base_url=url,
        model=args.model or "",
        api=args.api,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        timeout_s=args.timeout,
        headers=headers,
    )


def _id_range(spec: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--token-id-range must be LOW:HIGH integers, got {spec!r}") from None
    if not 0 <= low <= high:
        raise ValueError(f"--token-id-range needs 0 <= LOW <= HIGH, got {spec!r}")
    return low, high


async def _bench(args, target, workload, limits, id_range, progress) -> tuple[RunResult, Target]:
    async with httpx.AsyncClient(headers=target.headers, timeout=30) as client:
        if not target.model:
            target = dataclasses.replace(target, model=await _only_model(client, target))
        calibration = None
        if id_range is None:
            calibration = await _calibrate(client, target, args.seed)
    if args.redis_url:
        source = RegistrySource(args.redis_url, args.key_prefix, target.model)
    else:
        source = GatewayMetricsSource(metrics_url(target.base_url), target.model, target.headers)
    poller = ReplicaPoller(source, args.replica_poll_s)

    def make_prompt(index: int, tokens: int) -> str | list[int]:
        rng = request_rng(args.seed, index)
        if id_range is not None:
            return token_ids(tokens, rng, *id_range)
        return words(calibration.words_for(tokens), rng)

    return await run(target, workload, make_prompt, limits, progress, poller), target


async def _only_model(client: httpx.AsyncClient, target: Target) -> str:
    try:
        response = await client.get(f"{target.base_url}/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {target.base_url}/models: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{target.base_url}/models answered {response.status_code}: give --model")
    names = [m.get("id") for m in response.json().get("data", [])]
    if len(names) != 1:
        raise ValueError(f"give --model: the server lists {names or 'no models'}")
    return names[0]


async def _calibrate(client: httpx.AsyncClient, target: Target, seed: int) -> Calibration:
    probes = []
    for count in CALIBRATION_WORDS:
        text = words(count, random.Random(f"calibration:{seed}:{count}"))
        try:
            probes.append((count, await probe_prompt_tokens(client, target, text)))
        except httpx.HTTPError as exc:
            raise ValueError(f"calibration request to {target.url} failed: {exc}") from None
    return fit_calibration(probes)


def _config(args, target: Target, limits: RunLimits, prompt_mode: str) -> dict[str, Any]:
    """What the run was, for the JSON report (never the API key)."""
    return {
        "url": target.base_url,
        "model": target.model,
        "api": target.api,
        "num_requests": limits.num_requests,
        "duration_s": limits.duration_s,
        "concurrency": limits.concurrency,
        "rate": None if args.trace or math.isinf(args.rate) else args.rate,
        "burstiness": None if args.trace else args.burstiness,
        "input_tokens": None if args.trace else args.input_tokens,
        "output_tokens": None if args.trace else args.output_tokens,
        "trace": args.trace,
        "trace_time_scale": args.trace_time_scale if args.trace else None,
        "seed": args.seed,
        "prompt": prompt_mode,
        "ignore_eos": target.ignore_eos,
        "temperature": target.temperature,
        "timeout_s": target.timeout_s,
    }
