"""Device: the roofline figures of one accelerator (or this CPU) and its efficiencies.

A step's time is max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) plus a
fixed overhead (cost_model.py). The peaks are spec-sheet numbers; the
efficiencies say what share of them real kernels reach and are what
calibration (sim/calibrate.py) fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    name: str
    # Dense FLOP/s at the serving dtype (no sparsity).
    peak_flops: float
    # Memory read bandwidth, bytes/s.
    memory_bandwidth: float
    # Memory per device, bytes (weights + KV cache + activations).
    memory_bytes: float
    # Share of peak_flops that large matmuls reach.
    compute_efficiency: float = 0.8
    # Share of memory_bandwidth that weight and KV streaming reach.
    memory_efficiency: float = 0.85
    # Seconds every step costs besides the math: scheduling, launches, sampling.
    step_overhead_s: float = 0.0
    # Seconds per sequence in a step (metadata, sampling, detokenising).
    seq_overhead_s: float = 0.0
    # Tensor-parallel all-reduce bandwidth (bytes/s per device) and latency per all-reduce.
    link_bandwidth: float = 0.0
    link_latency_s: float = 0.0
    # Share of memory_bytes the engine may use (the rest: activations, CUDA context).
    usable_memory_fraction: float = 0.9
    # Share of the shorter of compute and memory time hidden under the longer: 1 is
    # the roofline's max() (GPUs stream weights while tensor cores work), 0 their
    # sum (one CPU thread streams and computes in turn).
    overlap: float = 1.0
    # Extra passes over the weights in a step of more than one token: CPU BLAS packs
    # each weight matrix into its own layout per call (a one-token step takes the
    # GEMV path, which does not). 0 on GPUs.
    repack_passes: float = 0.0
    # Devices one node joins with its interconnect (an HGX board: 8): the most a
    # tensor-parallel engine spans, since its all-reduces run over that link.
    gpus_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes"):
            _positive(name, getattr(self, name))
        for name in ("compute_efficiency", "memory_efficiency", "usable_memory_fraction"):
            value = getattr(self, name)
            if not 0.0 < _finite(name, value) <= 1.0:
                raise ValueError(f"device {self.name!r}: {name} must be in (0, 1], got {value!r}")
        if not 0.0 <= _finite("overlap", self.overlap) <= 1.0:
            raise ValueError(
                f"device {self.name!r}: overlap must be in [0, 1], got {self.overlap!r}"
            )
        for name in (
            "step_overhead_s",
            "seq_overhead_s",
            "link_bandwidth",
            "link_latency_s",
            "repack_passes",
        ):
            if _finite(name, getattr(self, name)) < 0:
                raise ValueError(f"device {self.name!r}: {name} must be >= 0")
        count = self.gpus_per_node
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"device {self.name!r}: gpus_per_node must be an integer >= 1")

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def achieved_bandwidth(self) -> float:
        return self.memory_bandwidth * self.memory_efficiency

    def with_efficiency(self, **fields: float) -> Device:
        """A copy with fitted efficiencies or overheads (calibration's output)."""
        return replace(self, **fields)


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive(name: str, value: object) -> None:
    if _finite(name, value) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


# NVIDIA H200 SXM: 989 TFLOP/s dense BF16 and 4.8 TB/s HBM3e (spec sheet), 141 GB.
# 80 % of peak for large GEMMs (~790 TFLOP/s achieved) and 85 % of HBM bandwidth
# are what well-tuned serving kernels report on Hopper; NVLink 4 gives ~450 GB/s
# per direction, of which a ring all-reduce sees ~360 GB/s at 8-64 MB messages.
# Not calibrated here (no GPU on the development machine): docs/simulator.md.
H200 = Device(
    name="h200",
    peak_flops=989e12,
    memory_bandwidth=4.8e12,
    memory_bytes=141e9,
    compute_efficiency=0.8,
    memory_efficiency=0.85,
    step_overhead_s=2e-3,
    seq_overhead_s=2e-6,
    link_bandwidth=360e9,
    link_latency_s=8e-6,
    gpus_per_node=8,
)

# This development machine (x86-64, fp32, torch on one thread, the engine's C++
# kernels): the peaks are bench/sim_calibration.py's measurements (a 2048^3
# matmul, a 256 MiB sum); overlap 0 (one thread computes and streams in turn);
# the efficiencies, overheads and repack passes its fit to real SmolLM2-135M
# engine steps (docs/simulator.md has the table).
CPU = Device(
    name="cpu",
    peak_flops=150e9,
    memory_bandwidth=11.6e9,
    memory_bytes=8e9,
    compute_efficiency=0.87,
    memory_efficiency=0.84,
    step_overhead_s=0.0,
    seq_overhead_s=1.6e-4,
    overlap=0.0,
    repack_passes=0.54,
)

_DEVICES = {d.name: d for d in (H200, CPU)}


def device(name: str) -> Device:
    """A preset by name ("h200", "cpu")."""
    try:
        return _DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(_DEVICES)}") from None


def device_names() -> tuple[str, ...]:
    return tuple(_DEVICES)
