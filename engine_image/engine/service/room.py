"""How many work entries an engine pulls from Redis now.

One rule, shared by the engine service (worker.py) and the cluster simulator
(sim/pod.py), so that the simulator runs the engine's own admission and not a
copy of it. Pure: it reads the scheduler's queues and the settings, no I/O.
"""

from __future__ import annotations

from tandem.engine.scheduler import Scheduler
from tandem.engine.service.settings import WorkerSettings
from tandem.protocol import Role


def pull_room(scheduler: Scheduler, settings: WorkerSettings, held: int, parked: int = 0) -> int:
    """Entries to take now: only what the engine can start soon.

    `held` counts the entries taken and not yet acknowledged. Nothing while KV
    usage is over the prefill watermark (what is pulled would only wait). A
    COMPLETION engine takes handoffs up to `max_running` in flight (max_num_seqs, or
    fewer where a decode step's budget holds fewer), and none while
    `parked` ones wait for room it has not got (those it took would wait with them,
    while another decoder, a replica just started say, might start them); a
    recompute waiting keeps its slot (it is held), and handoffs are pulled while the
    scheduler takes them in the room beside its blocks (scheduler_handoff.py); any other
    stops at `max_waiting_tokens` prompt tokens waiting, and else fills its
    waiting queue up to `max_waiting` entries and `max_running` in flight.
    A draining engine pulls nothing: callers check that first.
    """
    config = scheduler.config
    if scheduler.kv_usage > config.cache_prefill_watermark:
        return 0
    if settings.role is Role.COMPLETION:
        if parked or not scheduler.takes_handoffs():
            return 0
        return max(0, config.max_running - held)
    if scheduler.waiting_prompt_tokens >= settings.max_waiting_tokens:
        return 0
    return max(0, min(settings.max_waiting - scheduler.num_waiting, config.max_running - held))
