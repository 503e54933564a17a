"""Calibration: fit a device's efficiencies and overheads to measured step times.

    fitted = fit(samples, device, shape)   # samples: measured steps with their inputs
    rows = compare(samples, fitted.cost_model)

The model is  t = overhead + per_seq x seqs + max(F x a, B x b)  with F the
step's FLOPs, B its bytes, a = 1 / achieved FLOP/s, b = 1 / achieved bandwidth.
The max makes it piecewise linear, so the fit alternates: label each sample by
the bound the current parameters give it, solve the linear least squares of
that labelling, relabel, until the labels stop changing. Residuals are
relative (each row divided by its measured time) because step times span two
orders of magnitude and the goal is a bounded relative error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.sim.cost_model import CostModel, StepInputs
from tandem.sim.devices import Device
from tandem.sim.model_shapes import ModelShape


@dataclass(frozen=True)
class Sample:
    """One measured step: its kind and shape, and the median seconds it took."""

    kind: str  # "prefill" or "decode"
    batch: int
    # Prompt tokens per sequence (prefill) or cached context per sequence (decode).
    length: int
    seconds: float
    drafts: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', got {self.kind!r}")
        if self.batch < 1 or self.length < 1 or not self.seconds > 0:
            raise ValueError(f"sample needs batch, length >= 1 and seconds > 0: {self}")

    @property
    def inputs(self) -> StepInputs:
        if self.kind == "prefill":
            return StepInputs.prefill([self.length] * self.batch)
        return StepInputs.decode([self.length] * self.batch, self.drafts)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.batch}x{self.length}"


@dataclass(frozen=True)
class Fit:
    device: Device
    shape: ModelShape
    iterations: int

    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.device, self.shape)


@dataclass(frozen=True)
class Row:
    label: str
    measured_s: float
    predicted_s: float
    bound: str

    @property
    def error(self) -> float:
        """Relative error of the prediction: (predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def fit(samples: Sequence[Sample], device: Device, shape: ModelShape, max_iter: int = 50) -> Fit:
    """The device with efficiencies and overheads fitted to the samples.

    A fitted efficiency above 1 means the peak given was too low: the peak is
    raised to what the fit says and the efficiency set to 1 (Device keeps
    efficiencies in (0, 1]).
    """
    if len(samples) < 5:
        raise ValueError(f"fitting 5 parameters needs at least 5 samples, got {len(samples)}")
    if device.overlap == 0.0:
        return _fit_sum(samples, device, shape)
    unit = CostModel(device.with_efficiency(compute_efficiency=1.0, memory_efficiency=1.0), shape)
    work = np.array([unit.work(s.inputs) for s in samples])  # FLOPs, bytes
    seqs = np.array([s.inputs.seqs for s in samples], dtype=float)
    measured = np.array([s.seconds for s in samples])
    # Start from the peaks: which bound each sample hits on paper.
    params = np.array([0.0, 0.0, 1 / device.peak_flops, 1 / device.memory_bandwidth])
    compute_bound = work[:, 0] * params[2] >= work[:, 1] * params[3]
    iterations = 0
    for _ in range(max_iter):
        iterations += 1
        params = _solve(work, seqs, measured, compute_bound, params)
        relabelled = work[:, 0] * params[2] >= work[:, 1] * params[3]
        if (relabelled == compute_bound).all():
            break
        compute_bound = relabelled
    overhead, per_seq, a, b = (float(p) for p in params)
    return Fit(_fitted(device, overhead, per_seq, a, b), shape, iterations)


def _fit_sum(samples: Sequence[Sample], device: Device, shape: ModelShape) -> Fit:
    """A device whose compute and memory times add up (overlap 0): one linear fit.

    t = overhead + per_seq x seqs + a x FLOPs + b x bytes + r x weight bytes of
    multi-token steps; b gives the bandwidth and r / b the repack passes.
    """
    unit = CostModel(
        device.with_efficiency(compute_efficiency=1.0, memory_efficiency=1.0, repack_passes=0.0),
        shape,
    )
    inputs = [s.inputs for s in samples]
    work = np.array([unit.work(i) for i in inputs])
    multi = [shape.weight_bytes_read(i.tokens) if i.tokens > 1 else 0.0 for i in inputs]
    columns = [
        np.ones(len(samples)),
        np.array([i.seqs for i in inputs], dtype=float),
        work[:, 0],
        work[:, 1],
        np.array(multi),
    ]
    measured = np.array([s.seconds for s in samples])
    overhead, per_seq, a, b, r = _nonnegative_fit(columns, measured)
    a, b = max(a, 1e-30), max(b, 1e-30)
    return Fit(_fitted(device, overhead, per_seq, a, b, repack_passes=r / b), shape, 1)


def _fitted(
    device: Device, overhead: float, per_seq: float, a: float, b: float, **extra: float
) -> Device:
    """The device whose seconds per FLOP are a and per byte b: efficiencies against its
    peaks, the peaks raised where the fit beats them."""
    return device.with_efficiency(
        peak_flops=max(device.peak_flops, 1 / a),
        compute_efficiency=min(1.0, 1 / (a * device.peak_flops)),
        memory_bandwidth=max(device.memory_bandwidth, 1 / b),
        memory_efficiency=min(1.0, 1 / (b * device.memory_bandwidth)),
        step_overhead_s=overhead,
        seq_overhead_s=per_seq,
        **extra,
    )


def _nonnegative_fit(columns: list[np.ndarray], measured: np.ndarray) -> list[float]:
    """Least squares of relative errors with every coefficient >= 0 (negatives pinned at 0)."""
    params = [0.0] * len(columns)
    free = [i for i, c in enumerate(columns) if c.any()]
    while free:
        design = np.stack([columns[i] / measured for i in free], axis=1)
        solution, *_ = np.linalg.lstsq(design, np.ones_like(measured), rcond=None)
        negative = [free[j] for j, v in enumerate(solution) if v < 0]
        if not negative:
            for i, v in zip(free, solution, strict=True):
                params[i] = float(v)
            break
        free.remove(negative[0])
    return params


def _solve(
    work: np.ndarray,
    seqs: np.ndarray,
    measured: np.ndarray,
    compute_bound: np.ndarray,
    previous: np.ndarray,
) -> np.ndarray:
    """Weighted least squares for one labelling; parameters kept >= 0.

    A bound no sample hits cannot be fitted: its parameter keeps the previous
    value, so the next labelling still compares against something sensible.
    """
    columns = [
        np.ones_like(seqs),
        seqs,
        np.where(compute_bound, work[:, 0], 0.0),
        np.where(compute_bound, 0.0, work[:, 1]),
    ]
    params = previous.copy()
    free = [i for i in range(4) if columns[i].any()]
    fixed = [i for i in range(4) if i not in free]
    target = measured - sum((columns[i] * previous[i] for i in fixed), np.zeros_like(measured))
    while free:
        design = np.stack([columns[i] / measured for i in free], axis=1)
        solution, *_ = np.linalg.lstsq(design, target / measured, rcond=None)
        negative = [free[j] for j, v in enumerate(solution) if v < 0]
        if not negative:
            for i, v in zip(free, solution, strict=True):
                params[i] = v
            break
        # An overhead cannot be negative: pin the worst one at 0 and solve again.
        free.remove(negative[0])
        params[negative[0]] = 0.0
    # A rate must stay positive or the labelling divides by nothing.
    params[2] = max(params[2], 1e-30)
    params[3] = max(params[3], 1e-30)
    return params


def compare(samples: Sequence[Sample], model: CostModel) -> list[Row]:
    """Predicted against measured, one row per sample."""
    rows = []
    for s in samples:
        cost = model.cost(s.inputs)
        rows.append(Row(s.label, s.seconds, cost.total_s, cost.bound))
    return rows


def table(rows: Sequence[Row]) -> str:
    """A markdown table of the rows and the worst error."""
    lines = [
        "| step | measured ms | predicted ms | error | bound |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.measured_s * 1e3:.1f} | {r.predicted_s * 1e3:.1f} "
            f"| {r.error:+.0%} | {r.bound} |"
        )
    worst = max(rows, key=lambda r: abs(r.error))
    lines.append(f"\nworst error: {worst.error:+.1%} ({worst.label})")
    return "\n".join(lines)
