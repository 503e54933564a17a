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
import random
import sys
from pathlib import Path
from typing import Any

import httpx

from tandem.loadgen.arguments import Plan, add_arguments, check_arguments
from tandem.loadgen.client import Target, probe_prompt_tokens
from tandem.loadgen.progress import Progress, progress_enabled
from tandem.loadgen.prompts import Calibration, fit_calibration, request_rng, token_ids, words
from tandem.loadgen.replicas import (
    GatewayMetricsSource,
    RegistrySource,
    ReplicaPoller,
    metrics_url,
)
from tandem.loadgen.report import build_report, format_report
from tandem.loadgen.runner import RunResult, run
from tandem.outputs import say, write_failed

__all__ = ["add_arguments", "main"]  # add_arguments: what `tandem` builds the flags from

# Word counts of the two calibration probes of --prompt text.
CALIBRATION_WORDS = (50, 200)
# Seconds the /models probe and the calibration requests may take.
PROBE_TIMEOUT_S = 30.0


def main(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> int:
    """Run the bench; 0 when at least one request succeeded and every output was written,
    else 1. `transport` replaces the network (tests)."""
    plan = check_arguments(args)
    progress = Progress(sys.stderr, progress_enabled(sys.stderr, args.quiet))
    result, target = asyncio.run(_bench(args, plan, progress, transport))
    report = build_report(result, plan.slo, _config(args, target, plan))
    # The text first: whatever fails after it, the result has been shown.
    say(format_report(report))
    written = _write_outputs(args, report, result, target)
    if result.interrupted is not None:
        return 130  # a shell's status for Ctrl-C, after the report
    return 0 if report["requests"]["ok"] and written else 1


def _write_outputs(args, report: dict[str, Any], result: RunResult, target: Target) -> bool:
    """--json and --plots; False when one could not be written (each is tried)."""
    written = True
    if args.json:
        try:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as exc:
            write_failed("--json", args.json, exc)
            written = False
    if args.plots:
        from tandem.loadgen.plots import write_plots

        try:
            paths = write_plots(result, Path(args.plots), title=f"({target.model})")
        except OSError as exc:
            write_failed("--plots", args.plots, exc)
            return False
        for path in paths:
            say(f"plot         {path}")
    return written


async def _bench(
    args, plan: Plan, progress: Progress, transport: httpx.AsyncBaseTransport | None
) -> tuple[RunResult, Target]:
    target = plan.target
    async with httpx.AsyncClient(
        headers=target.headers, timeout=PROBE_TIMEOUT_S, transport=transport
    ) as client:
        target = dataclasses.replace(target, model=await _model(client, target))
        calibration = None
        if plan.id_range is None:
            calibration = await _calibrate(client, target, args.seed)
    if args.redis_url:
        source = RegistrySource(args.redis_url, args.key_prefix, target.model)
    else:
        url = metrics_url(target.base_url)
        source = GatewayMetricsSource(url, target.model, target.headers, transport)
    poller = ReplicaPoller(source, args.replica_poll_s)

    def make_prompt(index: int, tokens: int) -> str | list[int]:
        rng = request_rng(args.seed, index)
        if plan.id_range is not None:
            return token_ids(tokens, rng, *plan.id_range)
        return words(calibration.words_for(tokens), rng)

    result = await run(target, plan.workload, make_prompt, plan.limits, progress, poller, transport)
    return result, target


# What ends an endpoint's URL, never an API's base.
_ENDPOINTS = ("/completions", "/chat", "/models")


async def _model(client: httpx.AsyncClient, target: Target) -> str:
    """The model to send: --model, else the only one /models lists.

    /models is asked either way: an unreachable server stops the bench here
    (exit 2), not after the whole workload failed to connect.
    """
    url = f"{target.base_url}/models"
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {_reason(exc)}") from None
    if response.status_code == 404 and target.base_url.endswith(_ENDPOINTS):
        # The whole endpoint pasted (.../v1/completions): every request would be a 404.
        raise ValueError(
            f"{url} answered 404: --url is the API's base, ending in /v1 "
            f"(e.g. http://host:8000/v1), not {target.base_url}"
        )
    if response.status_code in (401, 403):  # every request would be refused alike
        raise ValueError(
            f"{url} answered {response.status_code}: the server refuses the API key; "
            "check --api-key (or $TANDEM_API_KEY / $OPENAI_API_KEY)"
        )
    names = _listed(response)
    if target.model:
        # Not every server lists its models (then any answer will do), and some serve
        # names they do not list (an alias, a model still starting): said, not refused.
        if names and target.model not in names:
            print(
                f"tandem: warning: --model {target.model}: {url} lists only {names}; "
                "requests may fail with 404",
                file=sys.stderr,
            )
        return target.model
    if response.status_code != 200:
        raise ValueError(f"{url} answered {response.status_code}: give --model")
    if names is None:
        raise ValueError(f"{url} answered no OpenAI model list: give --model")
    if len(names) != 1:
        raise ValueError(f"give --model: the server lists {names or 'no models'}")
    return names[0]


def _listed(response: httpx.Response) -> list[str] | None:
    """The model names of an OpenAI model list, or None for any other answer."""
    if response.status_code != 200:
        return None
    try:
        return [m["id"] for m in response.json()["data"] if isinstance(m.get("id"), str)]
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


async def _calibrate(client: httpx.AsyncClient, target: Target, seed: int) -> Calibration:
    probes = []
    for count in CALIBRATION_WORDS:
        text = words(count, random.Random(f"calibration:{seed}:{count}"))
        try:
            probes.append((count, await probe_prompt_tokens(client, target, text)))
        except httpx.HTTPError as exc:
            raise ValueError(
                f"calibration request to {target.url} failed: {_reason(exc)}"
            ) from None
    return fit_calibration(probes)


def _reason(exc: httpx.HTTPError) -> str:
    # httpx's timeouts carry no text: "cannot reach ...: " said nothing.
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    return str(exc) or type(exc).__name__


def _config(args, target: Target, plan: Plan) -> dict[str, Any]:
    """What the run was, for the JSON report (never the API key)."""
    limits = plan.limits
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
        "prompt": plan.prompt_mode,
        "ignore_eos": target.ignore_eos,
        "temperature": target.temperature,
        "timeout_s": target.timeout_s,
    }
