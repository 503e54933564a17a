"""QueueGauge's count of a model's waiting entries across a read in flight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tandem.gateway.admission import QueueGauge


@dataclass
class _Depth:
    total_waiting: int


class _PausedBroker:
    """A queue_depth that takes its snapshot at once and answers when released."""

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        self.release = asyncio.Event()

    async def queue_depth(self, model: str) -> _Depth:
        snapshot = self.waiting
        await self.release.wait()
        return _Depth(snapshot)


def test_an_entry_queued_while_a_read_is_in_flight_is_counted():
    # Queued after the read's snapshot and settled before its answer, the entry was in
    # neither: a burst queued 4 entries against a limit of 3.
    async def run() -> tuple[int | None, int]:
        broker = _PausedBroker(waiting=1)
        broker.release.set()
        gauge = QueueGauge(broker, max_age_s=60.0)
        assert await gauge.reserve("m", 1, limit=3) is None  # read: 1 waits; 1 reserved
        broker.release.clear()
        read = asyncio.ensure_future(gauge.reserve("m", 1, limit=2))  # at the limit: reads
        for _ in range(5):  # the read starts and takes its snapshot (1)
            await asyncio.sleep(0)
        broker.waiting += 1
        gauge.settle("m", 1, queued=True)  # the reserved entry lands after the snapshot
        broker.release.set()
        return await asyncio.wait_for(read, 5), await gauge.waiting("m", limit=10)

    assert asyncio.run(run()) == (2, 2)  # refused: 1 seen + 1 queued meanwhile
