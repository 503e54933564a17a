"""What a simulation run leaves behind: one record per request, pod lifetimes, scale events.

Plain data; sim/summary.py turns it into percentiles, goodput and GPU-seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline, in seconds from the start of the run."""

    arrival_s: float
    input_tokens: int
    # What the request asked for (max_tokens).
    output_tokens: int
    # When the first output token was sampled (the client sees it then).
    first_token_s: float | None = None
    # When the last output token was sampled.
    finish_s: float | None = None
    # Output tokens it generated: output_tokens, or fewer when its context reached
    # max_model_len (set when it finished).
    generated_tokens: int = 0
    # Why the request was refused (e.g. its prompt is over the engines' limit), and when.
    failure: str | None = None
    failed_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per generated token after the first (None for one-token outputs)."""
        if self.finish_s is None or self.first_token_s is None or self.generated_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.generated_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def truncated(self) -> bool:
        """It finished short of its output_tokens: the context reached max_model_len."""
        return self.finish_s is not None and self.generated_tokens < self.output_tokens


@dataclass(frozen=True, slots=True)
class PodLife:
    """One pod from the moment it was asked for (it holds its GPUs) until it was gone."""

    name: str
    role: str
    gpus: int
    created_s: float
    ready_s: float
    gone_s: float

    @property
    def gpu_seconds(self) -> float:
        return self.gpus * (self.gone_s - self.created_s)


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    time_s: float
    role: str
    from_replicas: int
    to_replicas: int
    # The autoscaler's own words (Decision.reason).
    reason: str


@dataclass(frozen=True, slots=True)
class ReplicaPoint:
    """One role's pods from an autoscaler evaluation that changed them (and at the start
    and the end) until the next point."""

    time_s: float
    role: str
    # What the autoscaler asked for.
    desired: int
    ready: int
    starting: int
    draining: int


class ReplicaTimeline:
    """The ReplicaPoints of a run: a role's point where its counts changed since its
    last (every role's where `always`): an idle stretch ticks on for nothing new, and
    kept a point a tick, its memory grew with the gap."""

    def __init__(self) -> None:
        self.points: list[ReplicaPoint] = []
        self._last: dict[str, ReplicaPoint] = {}  # each role's, in the timeline

    def record(self, point: ReplicaPoint, *, always: bool = False) -> None:
        last = self._last.get(point.role)
        if always or last is None or dataclasses.replace(last, time_s=point.time_s) != point:
            self.points.append(point)
            self._last[point.role] = point


@dataclass
class RunResult:
    records: list[RequestRecord]
    pods: list[PodLife]
    scale_events: list[ScaleEvent]
    timeline: list[ReplicaPoint]
    # When the run ended (the last event, or the requested horizon).
    end_s: float
    # Engine steps simulated (each pod step counts once, whatever its ranks).
    steps: int
    # Wall-clock seconds the simulation took.
    wall_s: float
    # Output tokens generated (every rank's decode and prefill samples).
    tokens: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_seconds(self) -> float:
        return sum(p.gpu_seconds for p in self.pods)
