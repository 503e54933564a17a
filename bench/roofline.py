"""This machine's roofline for the engine benches: its float32 matmul peak and read
bandwidth, probed in the run that uses them, and the FLOPs and bytes a decode step or a
prefill needs (bench/engine_throughput.py, bench/sim_calibration.py).

    probe = MachineProbe()
    window = best_machine([probe.measure() for _ in range(3)])
    tokens_per_s = decode_roofline(config, window, batch=64, context=96)

The peak is the best of the FMA GEMMs and, where the CPU has AMX, the engine's own
float32 products on its tiles: the bar includes the engine's fastest unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from tandem.engine.model.coded_weight import CodedWeight
from tandem.engine.model.linear import Linear, onednn_packed, pack_linears
from tandem.engine.model.model_config import ModelConfig

T = TypeVar("T")

READS = 2  # streaming reads of each of the probe's buffers per measure()
# Separately allocated 256 MiB buffers, each far past the caches: on a shared host one
# allocation read ~25 % slower than another, page placement the only difference
# (docs/benchmarks.md), so the read bandwidth is the best of several.
READ_BUFFERS = 4
CUDA_READS = 4  # reads of the GPU probe's one 2 GiB buffer per measure()


@dataclass
class Machine:
    matmul_flops: float  # FLOP/s of a large matmul in the model's dtype (the best GEMM)
    read_bytes: float  # bytes/s of a streaming read
    fma_flops: float  # the same, on the FMA units alone (without AMX's split planes)


class MachineProbe:
    """Times this machine's fp32 matmul peak and its read bandwidth: per `measure()`, one
    round of each GEMM and the best of READS reads of each of READ_BUFFERS buffers. The
    peak is the fastest of MKL (torch.mm), oneDNN's packed inner product and the engine's
    own projection path (linear.py: the panel kernel): on some CPUs one library is well
    short of the hardware, and the engine's kernel must not set the bar it is measured
    against alone. Where the CPU has AMX, also the engine's float32 products on its tiles
    (split_planes.py), of a weight of two bfloat16 planes and of one of int8 codes with
    float16 scales (a GGUF's): the peak such a model's products can reach here, above
    the FMA units'."""

    def __init__(self, n: int = 2048) -> None:
        self.n = n
        a, b = torch.randn(n, n), torch.randn(n, n)
        projection = Linear(n, n, bias=False)
        with torch.no_grad():
            projection.weight.copy_(b)
        self.gemms = [lambda: torch.mm(a, b)]  # on the FMA units: the first fma_gemms
        if pack_linears(projection):
            self.gemms.append(torch.inference_mode()(lambda: projection(a)))
        onednn = onednn_packed(b)
        if onednn is not None:
            self.gemms.append(torch.inference_mode()(lambda: onednn.product(a, None)))
        self.fma_gemms = len(self.gemms)
        # The tiles' products: of stored planes (float16 values: two bfloat16 planes) and
        # of codes (int8 codes with a float16 scale per 32 inputs, as Q8_0 stores them).
        planed, coded = Linear(n, n, bias=False), Linear(n, n, bias=False)
        codes = CodedWeight(
            torch.randint(-127, 128, (n, n), dtype=torch.int8),
            (torch.rand(n, n // 32) / 64).half().float(),
            None,
        )
        with torch.no_grad():
            planed.weight.copy_(b.half().float())
            coded.weight.copy_(codes.widened())
        coded.coded = codes
        for tiles in (planed, coded):
            if pack_linears(tiles) and tiles.packed.split is not None:
                self.gemms.append(torch.inference_mode()(lambda tiles=tiles: tiles(a)))
        self.reads = [torch.ones(256 * 1024 * 1024 // 4) for _ in range(READ_BUFFERS)]
        for warm in (*self.gemms, *(buffer.sum for buffer in self.reads)):
            warm()

    def measure(self) -> Machine:
        times = [timed(gemm) for gemm in self.gemms]
        # The best of a few reads (~15 ms each): one alone, just after the GEMMs, read as
        # little as half the bandwidth of the reads around it on this kind of host, and
        # put the roofline below what the engine then did (docs/benchmarks.md).
        read = min(timed(buffer.sum) for buffer in self.reads for _ in range(READS))
        flops, read_bytes = 2 * self.n**3, self.reads[0].numel() * 4
        return Machine(flops / min(times), read_bytes / read, flops / min(times[: self.fma_gemms]))


class CudaProbe:
    """An NVIDIA GPU's roofline in the engine's dtype there (bfloat16): the matmul peak of
    n-squared products and the read bandwidth of a sum over 2 GiB (far past the L2),
    timed to the GPU's completion. `measure()` as MachineProbe's; fma_flops is the peak
    itself (no split planes there)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, n: int = 8192) -> None:
        self.n, self.device = n, device
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.big = torch.ones(2 * 1024**3 // dtype.itemsize, device=device, dtype=dtype)
        for _ in range(3):  # clocks up, kernels chosen
            self.product()
            self.big.sum()

    def product(self) -> torch.Tensor:
        return torch.mm(self.a, self.b)

    def measure(self) -> Machine:
        flops = 2 * self.n**3 / min(timed(self.product, self.device) for _ in range(3))
        read = min(timed(self.big.sum, self.device) for _ in range(CUDA_READS))
        return Machine(flops, self.big.numel() * self.big.element_size() / read, flops)


def best_machine(machines: list[Machine]) -> Machine:
    return Machine(
        max(m.matmul_flops for m in machines),
        max(m.read_bytes for m in machines),
        max(m.fma_flops for m in machines),
    )


def measure_machine(rounds: int = 5) -> Machine:
    """The best peak and read bandwidth of `rounds` probes."""
    probe = MachineProbe()
    return best_machine([probe.measure() for _ in range(rounds)])


def interleaved(rounds: int, *measures: Callable[[], T]) -> list[list[T]]:
    """Each measure's values over rounds, taken in turn so that the machine's background
    load hits them alike (callers keep the best of each)."""
    values: list[list[T]] = [[] for _ in measures]
    for _ in range(rounds):
        for measure, out in zip(measures, values, strict=True):
            out.append(measure())
    return values


def figures(machine: Machine) -> str:
    return f"{machine.matmul_flops / 1e9:>8.0f} {machine.read_bytes / 1e9:>6.1f}"


def timed(fn, device: torch.device | None = None) -> float:
    """Seconds fn takes; on a GPU (device), from an idle GPU to fn's work done (its
    launches return before the work)."""
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if on_gpu:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# ------------------------------------------------------------------ roofline


def matmul_params(config: ModelConfig) -> int:
    """Weights a token multiplies through: everything but the embedding lookup."""
    embed = config.vocab_size * config.hidden_size
    lm_head = embed  # tied or not, the LM head is a vocab x hidden matmul
    untied_extra = 0 if config.tie_word_embeddings else embed
    return config.num_parameters - embed - untied_extra + lm_head


def decode_roofline(
    config: ModelConfig,
    machine: Machine,
    batch: int,
    context: int,
    weight_bytes: float | None = None,
    element_bytes: int = 4,
) -> float:
    """Upper bound on decode tokens/s: weights read once per step (element_bytes each,
    float32's 4 by default, unless weight_bytes says what a step streams) and the KV
    cache in element_bytes too, 2 FLOPs per weight per token."""
    params = matmul_params(config)
    kv_bytes = batch * context * config.kv_bytes_per_token * element_bytes
    attn_flops = 4 * batch * context * config.num_attention_heads * config.head_dim
    step_flops = 2 * params * batch + attn_flops * config.num_hidden_layers
    step_bytes = (params * element_bytes if weight_bytes is None else weight_bytes) + kv_bytes
    step = max(step_flops / machine.matmul_flops, step_bytes / machine.read_bytes)
    return batch / step


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs a prefill needs: every layer for every token, the LM head for the last one
    only (its logits are all the next token needs; HF computes them for every token)."""
    head = config.vocab_size * config.hidden_size
    layers = 2 * (matmul_params(config) - head) * tokens
    attn = 2 * tokens * tokens * config.num_attention_heads * config.head_dim  # causal half
    return layers + 2 * head + attn * config.num_hidden_layers
