"""Fitting a device to measured step times."""

import pytest

from tandem.sim import calibrate
from tandem.sim.cost_model import CostModel
from tandem.sim.devices import CPU, H200
from tandem.sim.model_shapes import model_shape

CASES = [("prefill", 1, 64), ("prefill", 1, 512), ("prefill", 4, 256), ("decode", 1, 64),
         ("decode", 8, 512), ("decode", 32, 256), ("decode", 64, 1024)]  # fmt: skip


def _samples(device, shape):
    model = CostModel(device, shape)
    return [
        calibrate.Sample(
            kind, batch, length, model.seconds(calibrate.Sample(kind, batch, length, 1.0).inputs)
        )
        for kind, batch, length in CASES
    ]


@pytest.mark.parametrize(
    "truth",
    [
        CPU.with_efficiency(
            compute_efficiency=0.6,
            memory_efficiency=0.7,
            repack_passes=0.5,
            step_overhead_s=0.003,
            seq_overhead_s=2e-4,
        ),
        H200.with_efficiency(compute_efficiency=0.7, memory_efficiency=0.8, step_overhead_s=0.001),
    ],
    ids=["sum", "roofline"],
)
def test_fit_recovers_the_device_that_made_the_times(truth):
    shape = model_shape("smollm2") if truth.name == "cpu" else model_shape("llama-8b")
    samples = _samples(truth, shape)
    start = truth.with_efficiency(compute_efficiency=1.0, memory_efficiency=1.0, repack_passes=0.0)
    fitted = calibrate.fit(samples, start, shape)
    rows = calibrate.compare(samples, fitted.cost_model)
    assert max(abs(r.error) for r in rows) < 0.02
    assert fitted.device.achieved_flops == pytest.approx(truth.achieved_flops, rel=0.05)
    assert "worst error" in calibrate.table(rows)


def test_too_few_samples_are_refused():
    with pytest.raises(ValueError, match="at least 5 samples"):
        calibrate.fit(_samples(CPU, model_shape("smollm2"))[:3], CPU, model_shape("smollm2"))
