"""HandoffSide: the scheduler's half of disaggregation, a mixin of Scheduler.

A PROMPT engine's prefilled requests stay pinned (scheduler.handoff) until a
decoder fetched their KV; a COMPLETION engine reserves blocks for a request
prefilled elsewhere (admit_handoff), then decodes it once the KV arrived, or
recomputes its prompt when it could not (handoff_received / handoff_failed).
Pure Python, no torch, like the scheduler it belongs to.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.config import EngineConfig, EngineType
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.waiting_queue import WaitingQueue


class HandoffSide:
    # Scheduler's state (scheduler.py says what each holds).
    config: EngineConfig
    kv: KVCacheManager
    requests: dict[str, Request]
    waiting: WaitingQueue
    running: list[Request]
    handoff: dict[str, Request]
    receiving: dict[str, Request]
    _register: Callable[[Request], None]
    _retire: Callable[[Request, RequestStatus], None]

    def release_handoff(self, request_id: str) -> None:
        """PROMPT engine: a decoder fetched the KV (or nobody did in time): free it."""
        request = self.handoff.pop(request_id, None)
        if request is not None:
            self._retire(request, RequestStatus.FINISHED_STOPPED)

    def admit_handoff(self, request: Request, first_token_ids: list[int]) -> list[int] | None:
        """COMPLETION engine: take a request prefilled elsewhere.

        first_token_ids are the tokens generated there (usually just the first).
        Reserves blocks for the KV of all but the last of them and returns the block table the
        transfer writes into, or None if there is no room (leave the handoff
        for another engine). Then call handoff_received or handoff_failed.
        """
        if self.config.engine_type is not EngineType.COMPLETION:
            raise ValueError("only a COMPLETION engine takes handoffs")
        if not first_token_ids:  # the KV of the prompt's last token comes with the first
            raise ValueError("a handoff carries the first token its prompt engine sampled")
        # KV arrives for every token but the newest sampled one, whose KV the
        # first decode step computes.
        num_kv_tokens = request.num_prompt_tokens + len(first_token_ids) - 1
        self._register(request)
        if not self._takes_handoff(num_kv_tokens) or (
            self.kv.allocate(request.request_id, num_kv_tokens) is None
        ):
            del self.requests[request.request_id]
            return None
        request.token_ids.extend(first_token_ids)
        request.block_ids = self.kv.block_table(request.request_id)
        self.receiving[request.request_id] = request
        return request.block_ids

    def takes_handoffs(self) -> bool:
        """Whether a handoff of one token's KV would be taken now: none is while a
        recompute waiting needs the room (the engine then pulls none to park)."""
        return self._takes_handoff(1)

    def _takes_handoff(self, num_kv_tokens: int) -> bool:
        """Room for a handoff's KV, as a prompt's admission has it: a free slot, and
        its blocks keep usage within the watermark (unless nothing else runs), the room
        decodes grow into (filled to the brim, the next decode step preempted the
        request whose KV just came over the network). A recompute waiting here (a
        failed fetch, a preempted request) keeps its slot and blocks: handoffs take only
        the room beside them, else a steady stream of them starved it until its
        deadline (and refusing every handoff while one waited left a near-empty decoder
        turning all away until its next attempt point, ~70 steps)."""
        cfg, kv = self.config, self.kv
        waiting = list(self.waiting)
        if len(self.running) + len(self.receiving) + len(waiting) >= cfg.max_running:
            return False
        if not (self.running or self.receiving or waiting):
            return True
        # A recompute mid-chunk holds its blocks already, counted in the usage (added
        # again, they turned away handoffs that fit through all of its chunks).
        still = [kv.blocks_for(r.num_tokens) - len(kv.block_table(r.request_id)) for r in waiting]
        needed = kv.blocks_for(num_kv_tokens) + sum(max(0, n) for n in still)
        return kv.usage_with(needed) <= cfg.cache_prefill_watermark

    def handoff_received(self, request_id: str, drafts: list[int] | None = None) -> None:
        """The prompt's KV arrived: the request decodes from its first token on, verifying
        `drafts` (placeholders where None: all an MTP head has before its first step)."""
        request = self.receiving.pop(request_id)
        request.num_computed_tokens = request.num_tokens - 1
        request.status = RequestStatus.RUNNING
        num_spec = self.config.num_speculative_tokens
        if num_spec:
            placeholders = [self.config.draft_placeholder_id] * num_spec
            request.draft_token_ids = placeholders if drafts is None else drafts[:num_spec]
        self.kv.cache_computed(request)
        self.running.append(request)

    def handoff_failed(self, request_id: str) -> None:
        """The KV could not be fetched: recompute the prompt here, first in line (behind
        a prompt mid-chunk)."""
        request = self.receiving.pop(request_id)
        self.kv.free(request_id)
        request.block_ids = []
        request.num_computed_tokens = 0
        self.waiting.add_first(request)
