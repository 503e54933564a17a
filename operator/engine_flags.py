"""The `tandem engine` flags of one role: the ConfigMap's data and the container's arguments.

One dict, two renderings: the ConfigMap shows people (and `kubectl diff`) what
the pods run, the arguments are what the engine reads (it has no config-file
flag), and a hash of the dict (with the operator's Redis Secret, which the pods
also read) in the pod template rolls the pods when it changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from tandem.operator.quantity import quantity_bytes, quantity_value
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.spec import ModelDeploymentSpec

ENGINE_CONTAINER = "engine"  # the engine pods' container that runs `tandem engine`
HTTP_PORT = 8100  # /healthz /readyz /metrics; rank r listens on HTTP_PORT + r
KV_PORT = 8200  # KV transfer (prefill engines); rank r listens on KV_PORT + r
# Where model volumes (a PVC, or the Hugging Face download) are mounted.
MODELS_DIR = "/models"
HUGGING_FACE_DIR = f"{MODELS_DIR}/huggingface"

# Flags that take no value: present when "true", absent when "false".
_SWITCHES = frozenset({"enable-chunked-prefill", "disable-prefix-caching", "enforce-eager"})


def model_argument(spec: ModelDeploymentSpec) -> str:
    """`--model`: the path the engine loads, where the pod template puts the weights."""
    source = spec.model
    if source.pvc is not None:
        sub_path = source.pvc.sub_path
        return f"{MODELS_DIR}/{sub_path.strip('/')}" if sub_path else MODELS_DIR
    if source.hugging_face is not None:
        return HUGGING_FACE_DIR
    if source.path is None:
        raise ValueError("spec.model has no source (validate the spec before building)")
    return source.path


def engine_flags(
    name: str, spec: ModelDeploymentSpec, role_name: RoleName, role: RoleSpec, key_prefix: str
) -> dict[str, str]:
    """Flag name (without --) to value, in the order the arguments get them."""
    engine = spec.engine
    flags = {
        "role": role_name.engine_role.value,
        "model": model_argument(spec),
        "served-model-name": spec.served_model_name(name),
        "key-prefix": key_prefix,
        "host": "0.0.0.0",
        "port": str(HTTP_PORT),
        "kv-port": str(KV_PORT),
        "data-parallel-size": str(role.data_parallel_size),
        "drain-timeout": str(role.drain_timeout_seconds),
    }
    optional = {
        "dtype": None if engine.dtype == "auto" else engine.dtype,
        "kv-cache-memory": None
        if engine.kv_cache_memory is None
        else quantity_bytes(engine.kv_cache_memory),
        "max-model-len": engine.max_model_len,
        "max-num-seqs": engine.max_num_seqs,
        "max-num-batched-tokens": engine.max_num_batched_tokens,
        "num-speculative-tokens": engine.num_speculative_tokens,
        "prefill-attempt-interval": engine.prefill_attempt_interval,
        "prefill-any-attempt-interval": engine.prefill_any_attempt_interval,
        "cache-prefill-watermark": engine.cache_prefill_watermark,
        "block-size": engine.block_size,
        "enable-chunked-prefill": _switch(engine.enable_chunked_prefill),
        "disable-prefix-caching": _switch(not engine.enable_prefix_caching),
        "enforce-eager": _switch(not engine.cuda_graphs),
        "threads": cpu_threads(role),
    }
    flags.update({flag: str(value) for flag, value in optional.items() if value is not None})
    return flags


def cpu_threads(role: RoleSpec) -> int | None:
    """Threads per rank from the pod's CPU limit, for a pod without GPUs; None: torch's default.

    torch counts the node's cores, not the container's CPU quota: a 4-CPU pod on a
    64-core node would run 64 OpenMP threads on 4 CPUs' time, spinning at each barrier.
    """
    limits = (role.resources.limits if role.resources else None) or {}
    if "cpu" not in limits or any(key.endswith("/gpu") for key in limits):
        return None
    cores = int(quantity_value(limits["cpu"]))  # whole cores; 500m -> 1 below
    return max(1, cores // role.data_parallel_size)


def engine_arguments(flags: Mapping[str, str]) -> list[str]:
    """The container's args for `tandem engine`, from the flags."""
    args: list[str] = []
    for flag, value in flags.items():
        if flag in _SWITCHES:
            if value == "true":
                args.append(f"--{flag}")
        else:
            # One word: a value that starts with "-" (a model named "-x") is not a flag.
            args.append(f"--{flag}={value}")
    return args


def config_hash(flags: Mapping[str, str], redis_secret: Mapping[str, str] | None = None) -> str:
    """A short digest of what the pods read at start, for the pod template: a changed
    flag, or a changed URL in the operator's Redis Secret (a rotated password), rolls them.

    The Secret's data enters only through the digest: the template shows no part of the URL.
    """
    digest = hashlib.sha256(_canonical(flags))
    if redis_secret is not None:
        digest.update(_canonical(redis_secret))
    return digest.hexdigest()[:16]


def _canonical(data: Mapping[str, str]) -> bytes:
    return json.dumps(dict(data), sort_keys=True, separators=(",", ":")).encode()


def _switch(on: bool) -> str:
    return "true" if on else "false"
