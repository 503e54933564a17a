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
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def mid_chunk(self, request: Request) -> bool:
        return self._holds_blocks(request.request_id)

    def add(self, request: Request) -> None:
        """A new request: behind every one of its priority or higher."""
        queue = self._queue
        if not queue or queue[-1].priority >= request.priority:
            queue.append(request)  # the usual case, without a walk
            return
        for at, queued in enumerate(queue):
            if queued.priority < request.priority and not self.mid_chunk(queued):
                queue.insert(at, request)
                return
        queue.append(request)

    def add_first(self, request: Request) -> None:
        """A request to recompute: ahead of every other, but behind prompts mid-chunk."""
        at = 0
        while at < len(self._queue) and self.mid_chunk(self._queue[at]):
            at += 1
        self._queue.insert(at, request)
