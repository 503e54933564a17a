"""Command-line flags of `tandem engine` (kept light: no torch, so `tandem --help` is quick).

A flag that sets an EngineConfig or WorkerSettings field defaults to the field's own
default, and `--help` shows it. check_arguments() refuses a value no engine could
start with before the model loads (minutes, for a big one): WorkerSettings' checks of
the fields its flags set (settings.check_values), and the rules of the flags no
setting holds. EngineConfig checks its fields when main.py builds it, after the load:
max_model_len and the KV cache's size come from the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from tandem.engine.config import EngineConfig, EngineType, check_fields
from tandem.engine.service.settings import WorkerSettings, check_values
from tandem.preflight import StartError, check_port
from tandem.protocol import Role, check_key_prefix, check_served_name

_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_WORKER = {f.name: f.default for f in dataclasses.fields(WorkerSettings)}

# EngineConfig fields a user may set on the command line: type and help.
_ENGINE_FLAGS = {
    "max_model_len": (
        int,
        "longest sequence, prompt and output, in tokens (default: the most the model's "
        "positions, the KV cache and, without chunked prefill, --max-num-batched-tokens allow)",
    ),
    "max_num_seqs": (int, "most sequences in flight at once"),
    "max_num_batched_tokens": (
        int,
        "token budget of one step (default: the largest of --max-model-len, 4096 and "
        "--max-num-seqs x (1 + --num-speculative-tokens))",
    ),
    "num_speculative_tokens": (int, "drafts verified per sequence in each decode step"),
    "prefill_attempt_interval": (
        int,
        "every this many decode steps, prefill if every data-parallel rank wants to",
    ),
    "prefill_any_attempt_interval": (
        int,
        "every this many decode steps, prefill if any data-parallel rank wants to",
    ),
    "cache_prefill_watermark": (
        float,
        "a rank takes new prompts only while this fraction of its KV cache or less is used",
    ),
    "block_size": (int, "tokens per KV cache block"),
}
# Derived when not given: max_model_len from the model and the KV cache (main.py;
# EngineConfig's own default does not apply), max_num_batched_tokens by EngineConfig.
_DERIVED = ("max_model_len", "max_num_batched_tokens")

# WorkerSettings fields a flag of the same name sets.
_WORKER_FLAGS = (
    "claim_idle_ms",
    "max_deliveries",
    "handoff_ttl",
    "drain_timeout",
    "kv_fetch_timeout",
    "max_waiting",
)

# Flags no setting holds, each with its minimum (data_parallel_size is EngineConfig's,
# but decides how many processes start, before there is one).
_AT_LEAST = {
    "port": 1,
    "kv_port": 0,  # 0: any free port
    "data_parallel_size": 1,
    "num_kv_blocks": 1,
    "kv_cache_memory": 1,
    "threads": 1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default="smollm2",
        help="a Hugging Face model directory, a .gguf file, smollm2 or random:<size> "
        "(default: %(default)s)",
    )
    model.add_argument(
        "--served-model-name", help="the name clients ask for (default: the --model value)"
    )
    model.add_argument(
        "--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, else float32)"
    )
    model.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if present)")
    model.add_argument(
        "--threads",
        type=int,
        help="CPU threads for the model, each rank's (default: torch's, every core it "
        "sees; a data-parallel group's ranks share the usable cores, within a CPU quota; "
        "give the cores this engine owns when several share a machine)",
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps op by op, not replayed from CUDA graphs (on a GPU)",
    )
    model.add_argument(
        "--seed",
        type=int,
        help="seed of the sampler's draws for requests that give none (default: a random one "
        "per engine and rank, so that replicas do not give the same answers)",
    )

    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--role",
        choices=[r.value for r in Role],
        default=str(_ENGINE["engine_type"]),
        help="normal: prefill and decode; prompt: prefill, then hand the KV cache to a "
        "completion engine; completion: decode what prompt engines prefilled "
        "(default: %(default)s)",
    )
    serving.add_argument(
        "--redis-url",
        default=os.environ.get("TANDEM_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the Redis the gateway and the engines share (default: $TANDEM_REDIS_URL, "
        "else redis://127.0.0.1:6379/0)",
    )
    serving.add_argument(
        "--redis-wait",
        type=float,
        default=60.0,
        help="seconds to wait at start for Redis to answer, before loading the model "
        "(in a cluster it may start after the engines) (default: %(default)s)",
    )
    serving.add_argument(
        "--key-prefix", default="tandem", help="prefix of every Redis key (default: %(default)s)"
    )
    serving.add_argument(
        "--host",
        default="0.0.0.0",
        help="address the HTTP and KV servers bind (default: %(default)s)",
    )
    serving.add_argument(
        "--advertise-host",
        help="address peers reach this engine at (default: --host, or when that is every "
        "interface, $POD_IP or this host's address)",
    )
    serving.add_argument(
        "--port",
        type=int,
        default=8100,
        help="HTTP port (/healthz /readyz /metrics); rank r listens on port + r "
        "(default: %(default)s)",
    )
    serving.add_argument(
        "--kv-port",
        type=int,
        default=8200,
        help="KV transfer port of the prompt role, 0 for any free one; rank r listens on "
        "kv-port + r (default: %(default)s)",
    )
    serving.add_argument(
        "--engine-id",
        help="this engine's name in the registry and the Redis groups (default: "
        "<role>-<host name>-<random>)",
    )
    serving.add_argument(
        "--data-parallel-size",
        type=int,
        default=_ENGINE["data_parallel_size"],
        help="ranks: engine processes, each with its own KV cache, voting on every step's "
        "type (default: %(default)s)",
    )

    engine = parser.add_argument_group("scheduler and KV cache")
    engine.add_argument(
        "--num-kv-blocks",
        type=int,
        help="KV cache blocks (default: as many as --kv-cache-memory holds)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=int,
        help="bytes for the KV cache (default: 1 GiB on the CPU, 90%% of the free GPU memory)",
    )
    engine.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="cut prompts that do not fit the rest of a step's budget into chunks",
    )
    engine.add_argument(
        "--disable-prefix-caching",
        action="store_true",
        help="do not reuse the KV of full blocks shared with earlier prompts",
    )
    for name, (kind, text) in _ENGINE_FLAGS.items():
        if name in _DERIVED:
            engine.add_argument(_flag(name), type=kind, help=text)
        else:
            default = _ENGINE[name]
            engine.add_argument(
                _flag(name), type=kind, default=default, help=f"{text} (default: %(default)s)"
            )

    service = parser.add_argument_group("queue, handoff and shutdown")
    service.add_argument(
        "--claim-idle-ms",
        type=int,
        default=_WORKER["claim_idle_ms"],
        help="work held this long by a silent engine is taken over (default: %(default)s)",
    )
    service.add_argument(
        "--max-deliveries",
        type=int,
        default=_WORKER["max_deliveries"],
        help="deliveries after which a request fails instead of being retried "
        "(default: %(default)s)",
    )
    service.add_argument(
        "--handoff-ttl",
        type=float,
        default=_WORKER["handoff_ttl"],
        help="seconds a prompt engine keeps prefilled KV for a completion engine to fetch "
        "(default: %(default)s)",
    )
    service.add_argument(
        "--kv-fetch-timeout",
        type=float,
        default=_WORKER["kv_fetch_timeout"],
        help="seconds a KV fetch may wait for the prompt engine's answer, then for each "
        "read of its frames, before the prompt is recomputed here instead (a transfer that "
        "keeps flowing is never cut; default: %(default)s)",
    )
    service.add_argument(
        "--drain-timeout",
        type=float,
        default=_WORKER["drain_timeout"],
        help="seconds running requests get to finish on SIGTERM (0: none; other engines "
        "take them over) (default: %(default)s)",
    )
    service.add_argument(
        "--max-waiting",
        type=int,
        default=_WORKER["max_waiting"],
        help="take new work only while fewer requests wait in this engine (load balance) "
        "(default: %(default)s)",
    )


# EngineConfig's field names as its messages write them, for the flags that set them.
_FIELD_NAMES = [*_ENGINE_FLAGS, "enable_chunked_prefill", "data_parallel_size"]
_FIELD_NAME = re.compile(rf"\b({'|'.join(_FIELD_NAMES)})\b")


_MOST_THREADS = 4096


def check_ports(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a port no rank could listen on (in use, a host
    this machine does not have), before minutes of model loading end in a traceback."""
    ports = [("--port", args.port + rank) for rank in range(args.data_parallel_size)]
    if args.role == "prompt" and args.kv_port:  # 0: any free port
        kv_ports = [("--kv-port", args.kv_port + r) for r in range(args.data_parallel_size)]
        if shared := sorted({p for _, p in ports} & {p for _, p in kv_ports}):
            # Each was free alone: the second server failed once the model had loaded.
            ranks = f" (a port per rank, {args.data_parallel_size} ranks)" if len(ports) > 1 else ""
            raise ValueError(
                f"--port {args.port} and --kv-port {args.kv_port} both take port "
                f"{shared[0]}{ranks}: give them ports apart"
            )
        ports += kv_ports
    for flag, port in ports:
        try:
            check_port(args.host, port, flag=flag, who="the engine")
        except StartError as exc:  # the command's error line, as every flag's
            raise ValueError(str(exc)) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a value no engine could start with."""
    for name, minimum in _AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"{_flag(name)} must be at least {minimum}, got {value}")
    for name in ("port", "kv_port"):
        last = getattr(args, name) + args.data_parallel_size - 1  # one port per rank
        if last > 65535:
            raise ValueError(f"{_flag(name)} must leave a port per rank below 65536, got {last}")
    # Past these torch's own check says "Overflow when unpacking long long", no flag.
    if args.threads is not None and args.threads > _MOST_THREADS:
        raise ValueError(f"--threads must be at most {_MOST_THREADS}, got {args.threads}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in 0..2**63-1, got {args.seed}")
    check_key_prefix(args.key_prefix, "--key-prefix")
    # Its registry entry and its consumer name in the Redis groups: an empty one would
    # be replaced by a generated id, silently, losing a restart's resume.
    if args.engine_id is not None and (
        not args.engine_id or any(c.isspace() for c in args.engine_id)
    ):
        raise ValueError(f"--engine-id must be non-empty without spaces, got {args.engine_id!r}")
    if not args.redis_wait >= 0:  # NaN too; 0: not at all
        raise ValueError(f"--redis-wait must be 0 or more seconds, got {args.redis_wait}")
    check_values(worker_fields(args), _flag)
    if args.served_model_name is not None:
        try:
            check_served_name(args.served_model_name)
        except ValueError as exc:
            raise ValueError(f"--served-model-name: {exc}") from None
    else:
        try:
            check_served_name(args.model)
        except ValueError:
            raise ValueError(
                f"--model {args.model!r} cannot be the served model name (it holds "
                "braces): give --served-model-name"
            ) from None
    try:
        check_fields(engine_fields(args))
    except ValueError as exc:  # its message names fields: name the flags that set them
        raise ValueError(_FIELD_NAME.sub(lambda m: _flag(m.group(0)), str(exc))) from None


def engine_fields(args: argparse.Namespace) -> dict[str, object]:
    """The EngineConfig fields the flags set; those in _DERIVED only when given."""
    fields = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    fields["enable_chunked_prefill"] = args.enable_chunked_prefill
    fields["enable_prefix_caching"] = not args.disable_prefix_caching
    fields["data_parallel_size"] = args.data_parallel_size
    fields["engine_type"] = EngineType(args.role)
    return fields


def worker_fields(args: argparse.Namespace) -> dict[str, float]:
    """The WorkerSettings fields the flags set."""
    return {name: getattr(args, name) for name in _WORKER_FLAGS}
