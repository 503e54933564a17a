"""Plots: the series they draw, and valid PNG files."""

import struct

import pytest

from tandem.loadgen.plots import cdf_points, throughput_series, write_plots
from tandem.loadgen.record import RequestRecord
from tandem.loadgen.replicas import ReplicaSample
from tandem.loadgen.runner import RunResult

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def record(index, start, e2e, tokens, chunks, ok=True):
    return RequestRecord(
        index=index,
        scheduled_s=start,
        start_s=start,
        input_tokens=4,
        max_tokens=tokens,
        status=200 if ok else 500,
        output_tokens=tokens,
        ttft_s=chunks[0] - start if chunks else None,
        e2e_s=e2e,
        chunk_times_s=chunks,
        error_kind=None if ok else "http_500",
    )


def test_cdf_points():
    assert cdf_points([3.0, 1.0, 2.0, 4.0]) == ([1.0, 2.0, 3.0, 4.0], [0.25, 0.5, 0.75, 1.0])


def test_throughput_series_buckets_requests_by_end_and_tokens_by_chunk():
    records = [
        # 4 tokens in 2 chunks (0.2 s and 1.2 s): 2 tokens each; ends at 1.5 s.
        record(0, 0.0, 1.5, 4, [0.2, 1.2]),
        # 3 tokens in 3 chunks in the first second; ends at 0.9 s.
        record(1, 0.1, 0.8, 3, [0.3, 0.5, 0.8]),
        # Failed: counts nowhere.
        record(2, 0.0, 0.1, 5, [0.05], ok=False),
    ]
    starts, done, tokens = throughput_series(records, 1.0)
    assert starts == [0.0, 1.0]
    assert done == [1.0, 1.0]
    assert tokens == [pytest.approx(2 + 3), pytest.approx(2)]
    # Half-second buckets: per-second rates are twice each bucket's content.
    starts, done, tokens = throughput_series(records, 0.5)
    assert starts == [0.0, 0.5, 1.0, 1.5]
    assert done == [0.0, 2.0, 0.0, 2.0]
    assert tokens == [pytest.approx(6.0), pytest.approx(4.0), pytest.approx(4.0), 0.0]
    assert throughput_series([], 1.0) == ([], [], [])
    with pytest.raises(ValueError):
        throughput_series(records, 0.0)


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_plots_are_valid_pngs(tmp_path):
    records = [
        record(i, i * 0.1, 1.0, 5, [i * 0.1 + 0.2 + j * 0.1 for j in range(5)]) for i in range(8)
    ]
    replicas = [
        ReplicaSample(0.0, {"prompt": 1, "completion": 1}),
        ReplicaSample(1.0, {"prompt": 1, "completion": 2}),
    ]
    result = RunResult(records, 1.7, 0.0, replicas)
    paths = write_plots(result, tmp_path / "plots", title="(test)")
    assert sorted(p.name for p in paths) == ["latency_cdfs.png", "replicas.png", "throughput.png"]
    for path in paths:
        width, height = png_size(path)
        assert width >= 400 and height >= 200
    # Without replica samples (not Tandem, or no --redis-url): no replicas plot.
    paths = write_plots(RunResult(records, 1.7, 0.0), tmp_path / "other")
    assert sorted(p.name for p in paths) == ["latency_cdfs.png", "throughput.png"]
