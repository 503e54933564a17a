"""The workload: an (often infinite) stream of requests to send, from distributions or a trace.

Each request is a TraceRequest (arrival offset, prompt and output lengths),
the same shape whether it was sampled or read from a file, so the runner
cannot tell the two apart. Sampling is seeded: one seed, one workload.
Arguments are checked when the workload is made, not when it is first read.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from tandem.lengths import LengthDist
from tandem.loadgen.arrivals import arrival_offsets, check_rate
from tandem.trace import TraceRequest


def synthetic_workload(
    rate: float,
    burstiness: float,
    input_tokens: LengthDist,
    output_tokens: LengthDist,
    seed: int,
    *,
    stationary: bool = False,
) -> Iterator[TraceRequest]:
    """Requests of these lengths arriving at `rate` (`stationary`: see arrival_offsets)."""
    check_rate(rate, burstiness)
    # Separate streams, so changing a length distribution keeps the arrival times.
    rng = random.Random(f"arrivals:{seed}")
    arrivals = arrival_offsets(rate, burstiness, rng, stationary=stationary)
    lengths = random.Random(f"lengths:{seed}")
    return (
        TraceRequest(arrival, input_tokens.sample(lengths), output_tokens.sample(lengths))
        for arrival in arrivals
    )


def trace_workload(
    requests: Sequence[TraceRequest], time_scale: float = 1.0
) -> Iterator[TraceRequest]:
    """The trace's requests; time_scale < 1 replays it faster (0.5: twice the rate)."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"--trace-time-scale must be a finite number > 0, got {time_scale}")
    # Checked here, not as each request is made: that would be after sending began.
    last = max((r.arrival_s for r in requests), default=0.0)
    if not math.isfinite(last * time_scale):
        raise ValueError(
            f"--trace-time-scale {time_scale:g} makes the trace's last arrival ({last:g} s) "
            "infinite"
        )
    return (
        TraceRequest(r.arrival_s * time_scale, r.input_tokens, r.output_tokens) for r in requests
    )
