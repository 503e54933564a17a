"""RequestRecord: what the client saw of one request, the unit every statistic is built from."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    # Position in the workload (0-based), so records can be matched to the plan.
    index: int
    # Planned arrival, seconds after the run started.
    scheduled_s: float
    # When the request was actually sent (a concurrency slot may delay it), seconds after start.
    start_s: float
    # Prompt tokens asked for by the workload.
    input_tokens: int
    # max_tokens sent (the workload's output length).
    max_tokens: int
    # HTTP status of the response, or None when no response came (timeout, connection).
    status: int | None = None
    # Prompt tokens as the server counted them (usage), None when it did not say.
    prompt_tokens: int | None = None
    # Output tokens: the server's usage when sent, else the number of text chunks.
    output_tokens: int | None = None
    # True when output_tokens came from the server's usage (exact), False when counted chunks.
    usage_reported: bool = False
    # Send to the first chunk with text, seconds; None when no token arrived.
    ttft_s: float | None = None
    # Send to the end of the response (or to the error), seconds.
    e2e_s: float | None = None
    # Arrival of each chunk with text, seconds after the run started (per-token timing).
    chunk_times_s: list[float] = field(default_factory=list)
    # "stop" or "length" as the server said; None when it did not finish.
    finish_reason: str | None = None
    # None on success; else a kind: "http_<status>", "stream_error", "timeout",
    # "connection", "protocol" (an unreadable answer).
    error_kind: str | None = None
    # The server's or the transport's message for the error.
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def end_s(self) -> float | None:
        """When the request ended, seconds after the run started."""
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1).

        None when undefined: a failed request, or fewer than two output tokens.
        """
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def chunk_gaps_s(self) -> list[float]:
        """Gaps between consecutive text chunks (inter-chunk latency)."""
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    def to_json(self) -> dict:
        """The scalar fields (chunk times omitted: they would dominate the file)."""
        return {
            "index": self.index,
            "scheduled_s": self.scheduled_s,
            "start_s": self.start_s,
            "input_tokens": self.input_tokens,
            "max_tokens": self.max_tokens,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "usage_reported": self.usage_reported,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "chunks": len(self.chunk_times_s),
            "finish_reason": self.finish_reason,
            "error_kind": self.error_kind,
            "error_message": self.error_message,
        }
