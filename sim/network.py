"""Network: how long moving a request's KV from a PROMPT to a COMPLETION engine takes.

    seconds = latency + bytes / bandwidth

Each engine has one link (a NIC) of `bandwidth` bytes/s. A transfer holds the
sender's and the receiver's links for its whole duration and starts when both
are free, so one prefill engine feeding many decoders, or one decoder fed by
many prefill engines, queues its transfers (store and forward, first come
first served). That is pessimistic against links that share bandwidth fairly
but gives the same total time for a batch of transfers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    # Bytes/s of one engine's link (e.g. 400 Gb/s InfiniBand: 50e9 / 8 x 8 = 50e9).
    bandwidth: float = 50e9
    # Seconds per transfer besides the bytes: connection, handshake, the ack.
    latency_s: float = 1e-3

    def __post_init__(self) -> None:
        if not math.isfinite(self.bandwidth) or self.bandwidth <= 0:
            raise ValueError(f"network bandwidth must be positive bytes/s, got {self.bandwidth!r}")
        if not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"network latency must be >= 0 seconds, got {self.latency_s!r}")

    def transfer_seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


class Links:
    """When each engine's link is next free: the transfers' queue."""

    def __init__(self, network: Network) -> None:
        self.network = network
        self._free_at: dict[str, float] = {}

    def reserve(self, sender: str, receiver: str, num_bytes: float, now: float) -> float:
        """Book a transfer; returns when it ends."""
        start = max(now, self._free_at.get(sender, 0.0), self._free_at.get(receiver, 0.0))
        end = start + self.network.transfer_seconds(num_bytes)
        self._free_at[sender] = self._free_at[receiver] = end
        return end

    def forget(self, engine: str) -> None:
        self._free_at.pop(engine, None)
