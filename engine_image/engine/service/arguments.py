"""Command-line flags of `tandem engine` (kept light: no torch, so `tandem --help` is quick)."""

from __future__ import annotations

import argparse
import os

from tandem.engine.config import EngineType
from tandem.protocol import Role

# Engine settings a user may pass on the command line, with their types.
_ENGINE_FLAGS = {
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "num_speculative_tokens": int,
    "prefill_attempt_interval": int,
    "prefill_any_attempt_interval": int,
    "cache_prefill_watermark": float,
    "block_size": int,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=[r.value for r in Role], default="normal")
    parser.add_argument(
        "--model", default="smollm2", help="HF directory, .gguf, smollm2, random:<size>"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients ask for (default: --model)"
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("TANDEM_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--redis-wait",
        type=float,
        default=60.0,
        help="seconds to wait at start for Redis to answer, before loading the model "
        "(in a cluster it may start after the engines)",
    )
    parser.add_argument("--key-prefix", default="tandem", help="prefix of every Redis key")
    parser.add_argument("--host", default="0.0.0.0", help="address the HTTP and KV servers bind")
    parser.add_argument("--advertise-host", default=None, help="address peers reach this engine at")
    parser.add_argument(
        "--port", type=int, default=8100, help="HTTP port (/healthz /readyz /metrics)"
    )
    parser.add_argument("--kv-port", type=int, default=8200, help="KV transfer port (prompt role)")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the model (default: torch's, every core it sees; give the "
        "cores this engine owns when several share a machine or a pod has a CPU limit)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps op by op, not replayed from CUDA graphs (on a GPU)",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    parser.add_argument("--enable-chunked-prefill", action="store_true")
    parser.add_argument("--disable-prefix-caching", action="store_true")
    for name, kind in _ENGINE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--claim-idle-ms", type=int, default=30_000)
    parser.add_argument("--max-deliveries", type=int, default=3)
    parser.add_argument("--handoff-ttl", type=float, default=30.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--kv-fetch-timeout", type=float, default=10.0)
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=16,
        help="take new work only while fewer requests wait in this engine (load balance)",
    )


# Flags checked before the model loads (minutes, for a big one), each with its minimum;
# those an engine setting checks (EngineConfig, WorkerSettings) say so again later.
_AT_LEAST = {
    "port": 1,
    "kv_port": 0,  # 0: any free port
    "data_parallel_size": 1,
    "num_kv_blocks": 1,
    "kv_cache_memory": 1,
    "threads": 1,
    "claim_idle_ms": 1,
    "max_deliveries": 1,
    "max_waiting": 1,
}
_POSITIVE = ("handoff_ttl", "kv_fetch_timeout")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a value no engine could start with."""
    for name, minimum in _AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {minimum}, got {value}")
    for name in ("port", "kv_port"):
        last = getattr(args, name) + args.data_parallel_size - 1  # one port per rank
        if last > 65535:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} must leave a port per rank below 65536, got {last}")
    for name in _POSITIVE:
        value = getattr(args, name)
        if not value > 0:  # NaN too
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("drain_timeout", "redis_wait"):  # 0: not at all
        value = getattr(args, name)
        if not value >= 0:  # NaN too
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} must be 0 or more seconds, got {value}")


def engine_fields(args: argparse.Namespace) -> dict[str, object]:
    fields = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    fields["enable_chunked_prefill"] = args.enable_chunked_prefill
    fields["enable_prefix_caching"] = not args.disable_prefix_caching
    fields["data_parallel_size"] = args.data_parallel_size
    fields["engine_type"] = EngineType(args.role)
    return fields
