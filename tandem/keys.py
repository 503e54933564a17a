"""Every Redis key and channel name of the protocol (tandem/protocol.py), under one prefix.

Work and handoff streams of a model share the hash tag {model}, so that what one
engine writes atomically about a model (a pull over every priority, a handoff
published with its work entry acknowledged) stays on one Redis Cluster slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol import PRIORITIES, PRIORITY_NORMAL


@dataclass(frozen=True)
class Keys:
    """The key names under one prefix (tests use their own)."""

    prefix: str = "tandem"

    def work_stream(self, model: str, priority: int) -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        return f"{self.prefix}:{{{model}}}:work:p{priority}"

    def work_streams(self, model: str) -> list[str]:
        """All work streams of a model, highest priority first."""
        return [self.work_stream(model, p) for p in PRIORITIES]

    def handoff_stream(self, model: str, priority: int = PRIORITY_NORMAL) -> str:
        """Where a prompt engine offers the model's prefilled requests of `priority`.
        Normal's keeps the name of the one stream earlier versions had: through a
        rolling upgrade, one version's prompt engines publish where the other's
        decoders read."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        level = "" if priority == PRIORITY_NORMAL else f":p{priority}"
        return f"{self.prefix}:{{{model}}}:handoff{level}"

    def handoff_streams(self, model: str) -> list[str]:
        """All handoff streams of a model, highest priority first."""
        return [self.handoff_stream(model, p) for p in PRIORITIES]

    def handoff_published(self, model: str, request_id: str) -> str:
        """The work entry id whose Handoff was published (work_queue's publish_handoff)."""
        return f"{self.prefix}:{{{model}}}:handed:{request_id}"

    def pullers(self, model: str, *, handoffs: bool) -> str:
        """Sorted set: the engines pulling a model's work (or handoff) streams, by the time
        of their last pull (work_queue's share of a burst among the live ones)."""
        return f"{self.prefix}:{{{model}}}:{'handoff' if handoffs else 'work'}:pullers"

    def queued_tokens(self, model: str) -> str:
        """Counter of (estimated) prompt tokens queued and not yet taken by an engine."""
        return f"{self.prefix}:{{{model}}}:queued_tokens"

    def enqueued(self, model: str, request_id: str) -> str:
        """Marks a request id queued (tandem.backlog's enqueue), for the entry id it got."""
        return f"{self.prefix}:{{{model}}}:enqueued:{request_id}"

    def response_stream(self, request_id: str) -> str:
        return f"{self.prefix}:resp:{request_id}"

    def cancel_key(self, request_id: str) -> str:
        return f"{self.prefix}:cancel:{request_id}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    def engine_key(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"

    def probe_key(self, engine_id: str) -> str:
        """Written by an engine waiting for Redis to take writes again."""
        return f"{self.prefix}:probe:{engine_id}"

    @property
    def engines_set(self) -> str:
        return f"{self.prefix}:engines"

    def model_key(self, model: str) -> str:
        """A model a controller serves, live engines or not (catalog.py)."""
        return f"{self.prefix}:model:{model}"

    @property
    def data_epoch(self) -> str:
        """Set once, never changed: gone, Redis lost its data (engine/service/data_epoch.py)."""
        return f"{self.prefix}:epoch"

    @property
    def models_set(self) -> str:
        return f"{self.prefix}:models"
