"""From a model spec to a model in memory and a KV cache sized for it.

loaded = load_model("smollm2")                 # weights on the device
num_blocks = kv_blocks_for(loaded.config, ...) # from a memory budget
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.source import ModelSource, resolve_model

# KV cache on the CPU when no budget is given: enough for SmolLM2 at 8k tokens
# several times over, small enough for a laptop.
DEFAULT_CPU_KV_BYTES = 1 << 30
# Share of the GPU memory left after the weights that the KV cache may take.
GPU_KV_FRACTION = 0.90

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    source: ModelSource
    model: LlamaForCausalLM
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self) -> ModelConfig:
        return self.source.config


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA device is available")
    return chosen


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on GPUs, fp32 on the CPU unless asked otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(_DTYPES)}") from None


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Resolve a model spec (see resolve_model) and load its weights onto the device."""
    source = resolve_model(spec)
    chosen_device = pick_device(device)
    chosen_dtype = pick_dtype(dtype, chosen_device)
    model = LlamaForCausalLM(source.config, dtype=chosen_dtype, device=chosen_device)
    model.load_weights(source.iter_weights())
    model.load_codes(source.iter_codes())
    model.eval()
    model.pack_projections()  # on the CPU: pre-packed projections (linear.py)
    return LoadedModel(source, model, chosen_device, chosen_dtype)


def kv_blocks_for(
    config: ModelConfig,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_bytes: int | None = None,
) -> int:
    """KV blocks that fit a memory budget (default: 1 GiB on CPU, 90 % of free GPU memory)."""
    bytes_per_block = config.kv_bytes_per_token * block_size * dtype.itemsize
    if kv_cache_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free * GPU_KV_FRACTION)
        else:
            kv_cache_bytes = DEFAULT_CPU_KV_BYTES
    blocks = kv_cache_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"a KV budget of {kv_cache_bytes} bytes holds no block of {bytes_per_block} bytes"
        )
    return int(blocks)
