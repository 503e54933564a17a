"""`tandem bench`'s flags, and every check on them, all made before anything is sent.

A bad or pointless flag is a ValueError naming it (`tandem: error: ...`,
exit 2): found before a run that may take hours, not after. Flags that only
apply with others (--trace's four alternatives, --trace-time-scale, ...)
default to None, so that one given where it would be ignored is refused.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from tandem.lengths import parse_length
from tandem.loadgen.client import Target
from tandem.loadgen.report import Slo
from tandem.loadgen.runner import RunLimits
from tandem.loadgen.workload import synthetic_workload, trace_workload
from tandem.outputs import check_dir, check_file
from tandem.redaction import check_redis_url
from tandem.trace import TraceRequest, read_trace

DEFAULT_REQUESTS = 100
# The defaults of the flags that default to None, applied once they are checked.
DEFAULTS = {
    "rate": math.inf,
    "burstiness": 1.0,
    "input_tokens": "128",
    "output_tokens": "64",
    "trace_time_scale": 1.0,
    "token_id_range": "10:499",
    "key_prefix": "tandem",
}
# What a trace replaces.
TRACE_REPLACES = ("rate", "burstiness", "input_tokens", "output_tokens")
# The OpenAI API's range; a server may accept more, but a bench should not depend on it.
MAX_TEMPERATURE = 2.0


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
    load.add_argument("--rate", type=float, help="requests/s (default inf: all at once)")
    load.add_argument(
        "--burstiness", type=float, help="gamma shape: 1 (default) Poisson, < 1 bursty"
    )
    load.add_argument("--concurrency", type=int, default=64, help="in flight at most; 0: no cap")
    load.add_argument("--input-tokens", help="length spec (docs/bench-client.md), default 128")
    load.add_argument("--output-tokens", help="length spec, default 64")
    load.add_argument("--trace", default=None, help="JSONL trace: arrivals and lengths")
    load.add_argument("--trace-time-scale", type=float, help="0.5: replay 2x faster (default 1)")
    load.add_argument("--seed", type=int, default=0)
    prompt = parser.add_argument_group("requests")
    prompt.add_argument(
        "--prompt", choices=["ids", "text"], default=None, help="ids (completions default) or text"
    )
    prompt.add_argument("--token-id-range", help="LOW:HIGH of --prompt ids (default 10:499)")
    prompt.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers refusing it)"
    )
    prompt.add_argument("--temperature", type=float, default=0.0, help="0 (default) to 2")
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
    tandem.add_argument("--key-prefix", help="of --redis-url's keys (default tandem)")
    tandem.add_argument("--replica-poll-s", type=float, default=1.0)


@dataclass(frozen=True)
class Plan:
    """What the checked flags ask for."""

    limits: RunLimits
    workload: Iterator[TraceRequest]
    slo: Slo
    # The model is "" until /models names it (no --model).
    target: Target
    # "ids" or "text".
    prompt_mode: str
    # LOW, HIGH of --prompt ids; None with --prompt text.
    id_range: tuple[int, int] | None


def check_arguments(args: argparse.Namespace) -> Plan:
    """Check every flag (ValueError naming it) and fill in the defaults of those left None."""
    prompt_mode = args.prompt or ("text" if args.api == "chat" else "ids")
    _refuse_unused(args, prompt_mode)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if prompt_mode == "ids" and args.api == "chat":
        raise ValueError("--prompt ids needs --api completions (chat messages are text)")
    if not 0 <= args.temperature <= MAX_TEMPERATURE:  # also refuses NaN
        raise ValueError(f"--temperature must be between 0 and 2, got {args.temperature}")
    if args.redis_url:  # neither the URL nor redis-py's reason: either may hold the password
        check_redis_url(args.redis_url, "--redis-url")
    limits, workload = _load(args)
    plan = Plan(
        limits=limits,
        workload=workload,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms),
        target=_target(args),
        prompt_mode=prompt_mode,
        id_range=_id_range(args.token_id_range) if prompt_mode == "ids" else None,
    )
    # Last, once nothing else can refuse the run: the paths are written only after it.
    if args.json:
        check_file("--json", args.json)
    if args.plots:
        check_dir("--plots", args.plots)
    return plan


def _refuse_unused(args: argparse.Namespace, prompt_mode: str) -> None:
    """A flag that would be silently ignored is a mistake: say so."""
    given = {name for name in DEFAULTS if getattr(args, name) is not None}
    if args.trace:
        for name in TRACE_REPLACES:
            if name in given:
                raise ValueError(f"{_flag(name)} cannot be used with --trace: the trace sets it")
    elif "trace_time_scale" in given:
        raise ValueError("--trace-time-scale needs --trace")
    elif "burstiness" in given and (args.rate is None or math.isinf(args.rate)):
        raise ValueError("--burstiness needs a finite --rate (at rate inf all are sent at once)")
    if "token_id_range" in given and prompt_mode != "ids":
        raise ValueError("--token-id-range needs --prompt ids")
    if "key_prefix" in given and not args.redis_url:
        raise ValueError("--key-prefix needs --redis-url")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _load(args: argparse.Namespace) -> tuple[RunLimits, Iterator[TraceRequest]]:
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.duration is not None and not 0 < args.duration < math.inf:
        raise ValueError(f"--duration must be a finite number > 0 s, got {args.duration}")
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
        # A run of a set duration starts stationary: it offers --rate x --duration.
        timed = args.duration is not None
        workload = synthetic_workload(
            args.rate, args.burstiness, inputs, outputs, args.seed, stationary=timed
        )
        if num is None and args.duration is None:
            num = DEFAULT_REQUESTS
        if num is None and math.isinf(args.rate) and concurrency is None:
            raise ValueError("--rate inf with --duration needs a --concurrency cap")
    return RunLimits(num, args.duration, concurrency), workload


def _target(args: argparse.Namespace) -> Target:
    url = args.url.rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
        httpx.URL(url)  # whatever else httpx would refuse once the run started
    except (ValueError, httpx.InvalidURL) as exc:
        raise ValueError(f"--url {args.url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be an http(s) URL, got {args.url!r}")
    if parts.path in ("", "/"):
        url += "/v1"  # a bare host: the OpenAI API lives under /v1
    key, source = _api_key(args)
    if key and not (key.isascii() and key.isprintable()):
        # Not echoed: it is a secret. (A pasted smart quote failed later in the words of
        # an ASCII codec; a trailing newline as "cannot reach" the server.)
        raise ValueError(f"{source} must be printable ASCII (it travels in a header)")
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


def _api_key(args: argparse.Namespace) -> tuple[str | None, str]:
    """The API key and where it came from (a flag or a variable), for its errors."""
    if args.api_key:
        return args.api_key, "--api-key"
    for variable in ("TANDEM_API_KEY", "OPENAI_API_KEY"):
        if os.environ.get(variable):
            return os.environ[variable], variable
    return None, "--api-key"


def _id_range(spec: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--token-id-range must be LOW:HIGH integers, got {spec!r}") from None
    if not 0 <= low <= high < 2**31:
        raise ValueError(f"--token-id-range needs 0 <= LOW <= HIGH < 2**31, got {spec!r}")
    return low, high
