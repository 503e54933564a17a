"""The roofline cost model and the KV transfer time."""

import pytest

from tandem.sim.cost_model import CostModel, StepInputs
from tandem.sim.devices import H200, Device
from tandem.sim.model_shapes import model_shape
from tandem.sim.network import Links, Network

LLAMA_8B = model_shape("llama-8b")


def test_decode_time_grows_with_batch_and_context():
    model = CostModel(H200, LLAMA_8B)
    by_batch = [model.seconds(StepInputs.decode([1024] * b)) for b in (1, 8, 64, 256)]
    by_context = [model.seconds(StepInputs.decode([c] * 32)) for c in (128, 1024, 8192)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1]
    assert by_context == sorted(by_context) and by_context[0] < by_context[-1]


def test_prefill_time_grows_with_prompt_length():
    model = CostModel(H200, LLAMA_8B)
    times = [model.seconds(StepInputs.prefill([n])) for n in (128, 1024, 4096, 8192)]
    assert times == sorted(times) and times[0] < times[-1]


def test_small_decode_is_memory_bound_and_long_prefill_compute_bound():
    model = CostModel(H200, LLAMA_8B)
    decode = model.cost(StepInputs.decode([512]))
    prefill = model.cost(StepInputs.prefill([8192]))
    assert decode.bound == "memory"
    assert prefill.bound == "compute"
    # A memory-bound step takes at least the weights it reads over the bandwidth.
    assert decode.memory_s >= LLAMA_8B.weight_bytes_read(1) / H200.achieved_bandwidth
    # A compute-bound step is within the roofline: FLOPs over achieved FLOP/s.
    flops, _ = model.work(StepInputs.prefill([8192]))
    assert prefill.compute_s == pytest.approx(flops / H200.achieved_flops)


def test_tensor_parallelism_splits_the_work_and_adds_communication():
    one = CostModel(H200, model_shape("llama-70b"), tp=4).cost(StepInputs.decode([1024] * 64))
    two = CostModel(H200, model_shape("llama-70b"), tp=8).cost(StepInputs.decode([1024] * 64))
    assert two.memory_s == pytest.approx(one.memory_s / 2)
    assert two.comm_s > 0 and one.comm_s > 0


def test_a_model_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="raise tp"):
        CostModel(H200, model_shape("llama-70b"), tp=1).kv_blocks(16)


def test_moe_reads_only_the_experts_it_touches():
    moe = model_shape("moe-8x7b")
    assert moe.weight_bytes_read(1) < moe.weight_bytes_read(64) <= moe.weight_bytes * 1.01
    assert moe.body_params < moe.total_params


def test_device_rejects_bad_figures():
    with pytest.raises(ValueError, match="compute_efficiency"):
        Device("x", 1e12, 1e9, 1e9, compute_efficiency=1.5)


def test_kv_transfer_time_is_bytes_over_bandwidth():
    network = Network(bandwidth=10e9, latency_s=0.0)
    assert network.transfer_seconds(5e9) == pytest.approx(0.5)
    with_latency = Network(bandwidth=10e9, latency_s=0.002)
    assert with_latency.transfer_seconds(5e9) == pytest.approx(0.502)


def test_transfers_sharing_a_link_queue():
    links = Links(Network(bandwidth=1e9, latency_s=0.0))
    first = links.reserve("p1", "d1", 1e9, now=0.0)
    second = links.reserve("p1", "d2", 1e9, now=0.0)  # same sender: after the first
    third = links.reserve("p2", "d3", 1e9, now=0.0)  # other links: at once
    assert (first, second, third) == pytest.approx((1.0, 2.0, 1.0))
