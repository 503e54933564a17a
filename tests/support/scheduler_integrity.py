"""check_integrity: a Scheduler's queues, its requests and its KV bookkeeping agree."""

from __future__ import annotations

from tandem.engine.scheduler import Scheduler


def check_integrity(scheduler: Scheduler) -> None:
    """Raise AssertionError if the scheduler's and its KV manager's bookkeeping disagree."""
    kv = scheduler.kv
    kv.check_integrity()
    placed = (
        [r.request_id for r in scheduler.waiting]
        + [r.request_id for r in scheduler.running]
        + list(scheduler.handoff)
        + list(scheduler.receiving)
    )
    if sorted(placed) != sorted(scheduler.requests):
        raise AssertionError("a request is lost or in two queues")
    for request in scheduler.running:
        if request.block_ids is not kv.block_table(request.request_id):
            raise AssertionError(f"running request {request.request_id!r} lost its table")
        if request.num_computed_tokens != request.num_tokens - 1:
            raise AssertionError(f"running request {request.request_id!r} is not decodable")
    if len(scheduler.running) > scheduler.config.max_num_seqs:
        raise AssertionError("more running requests than max_num_seqs")
