"""The prefill queue: the order in which an engine's waiting prompts are admitted.

Highest priority first, arrival order within a priority. A prompt mid-chunk
(it holds the blocks for its whole prompt, half written) stays at the front
whatever comes: anything put ahead of it would wait for blocks it holds while
it waits behind that, and prefill would stall for good. A request that goes
back to be recomputed (preempted, or its KV handoff failed) goes first, but
behind such a prompt.

Pure Python, as the scheduler that owns it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from tandem.engine.request import Request


class WaitingQueue:
    """Waiting requests in admission order; `holds_blocks(request_id)` tells a prompt
    mid-chunk (the KV manager's word for it)."""

    def __init__(self, holds_blocks: Callable[[str], bool]) -> None:
        self._queue: deque[Request] = deque()
        self._holds_blocks = holds_blocks
        # Requests put first to be recomputed, while they wait: new ones go behind them.
        self._recomputes: set[str] = set()

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def first(self) -> Request | None:
        """The next to admit, if any."""
        return self._queue[0] if self._queue else None

    def pop_first(self) -> Request:
        request = self._queue.popleft()
        self._recomputes.discard(request.request_id)
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self._recomputes.discard(request.request_id)

    def mid_chunk(self, request: Request) -> bool:
        return self._holds_blocks(request.request_id)

    def add(self, request: Request) -> None:
        """A new request: behind every one of its priority or higher, and behind the
        recomputes and a prompt mid-chunk at the front whatever their priority."""
        queue = self._queue
        at = len(queue)  # usually the end, without a walk
        while at and queue[at - 1].priority < request.priority and not self._first(at - 1):
            at -= 1
        queue.insert(at, request)

    def add_first(self, request: Request) -> None:
        """A request to recompute: ahead of every other, but behind prompts mid-chunk."""
        at = 0
        while at < len(self._queue) and self.mid_chunk(self._queue[at]):
            at += 1
        self._queue.insert(at, request)
        self._recomputes.add(request.request_id)

    def _first(self, at: int) -> bool:
        """Whether the entry at `at` keeps its place ahead of new requests."""
        queued = self._queue[at]
        return queued.request_id in self._recomputes or self.mid_chunk(queued)
