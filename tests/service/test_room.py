"""pull_room: how much work an engine takes from Redis (shared with the simulator)."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig, EngineType
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.service.room import pull_room
from tandem.engine.service.settings import WorkerSettings, waiting_tokens
from tandem.protocol import Role

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def settings(role: Role, **fields) -> WorkerSettings:
    return WorkerSettings(role=role, model_name="m", engine_id="e", http_address="", **fields)


def scheduler(engine_type=EngineType.NORMAL, num_blocks=4096, **fields) -> Scheduler:
    return Scheduler(EngineConfig(engine_type=engine_type, **fields), num_blocks=num_blocks)


def queue_prompts(sched: Scheduler, count: int, length: int) -> None:
    for i in range(count):
        sched.add_request(Request(f"r{i}", list(range(length)), PARAMS))


def test_an_idle_engine_fills_its_waiting_queue():
    sched = scheduler(max_num_seqs=256)
    assert pull_room(sched, settings(Role.NORMAL, max_waiting=16), held=0) == 16


def test_waiting_entries_and_held_ones_use_up_the_room():
    sched = scheduler(max_num_seqs=20)
    queue_prompts(sched, 5, 8)
    # 16 waiting entries at most, 5 taken; and 20 in flight at most, 18 held.
    assert pull_room(sched, settings(Role.NORMAL, max_waiting=16), held=5) == 11
    assert pull_room(sched, settings(Role.NORMAL, max_waiting=16), held=18) == 2
    assert pull_room(sched, settings(Role.NORMAL, max_waiting=16), held=25) == 0


def test_enough_waiting_prompt_tokens_stop_the_pulling():
    sched = scheduler()
    queue_prompts(sched, 2, 600)
    assert pull_room(sched, settings(Role.PROMPT, max_waiting_tokens=1_200), held=2) == 0
    assert pull_room(sched, settings(Role.PROMPT, max_waiting_tokens=1_201), held=2) == 14


def test_kv_over_the_watermark_takes_nothing():
    sched = scheduler(num_blocks=128, max_model_len=2048)
    queue_prompts(sched, 1, 1_900)  # 119 of 128 blocks once admitted
    sched.schedule()
    assert sched.kv_usage > sched.config.cache_prefill_watermark
    assert pull_room(sched, settings(Role.NORMAL), held=1) == 0


@pytest.mark.parametrize("held", [0, 7, 300])
def test_a_completion_engine_takes_handoffs_up_to_its_sequences(held):
    sched = scheduler(EngineType.COMPLETION, max_num_seqs=8)
    # The waiting limits are for prompts: a decoder only counts what it runs.
    got = pull_room(sched, settings(Role.COMPLETION, max_waiting=1, max_waiting_tokens=1), held)
    assert got == max(0, 8 - held)


def test_a_completion_engine_with_a_handoff_waiting_for_room_takes_no_more():
    # What it took now would wait behind it, where another decoder might start it.
    sched = scheduler(EngineType.COMPLETION, max_num_seqs=8)
    assert pull_room(sched, settings(Role.COMPLETION), held=3, parked=1) == 0
    assert pull_room(sched, settings(Role.COMPLETION), held=3, parked=0) == 5


def test_a_completion_engine_takes_only_the_handoffs_its_budget_can_decode():
    # A budget below max_num_seqs (chunked prefill allows it) runs fewer sequences
    # (EngineConfig.max_running): handoffs pulled past it parked, went back, and came
    # again, a cycle through Redis for as long as the engine was full.
    sched = scheduler(
        EngineType.COMPLETION, max_num_seqs=8, max_num_batched_tokens=4,
        enable_chunked_prefill=True, max_model_len=64,
    )  # fmt: skip
    assert pull_room(sched, settings(Role.COMPLETION), held=0) == 4
    assert pull_room(sched, settings(Role.COMPLETION), held=4) == 0


def test_a_completion_engine_with_a_recompute_waiting_takes_handoffs_beside_it():
    # One failed fetch stopped the pulling until the recompute's prefill, up to ~70
    # decode steps, on a decoder whose scheduler takes handoffs beside it.
    sched = scheduler(EngineType.COMPLETION, max_num_seqs=8)
    request = Request("r", list(range(20)), PARAMS)
    assert sched.admit_handoff(request, [7]) is not None
    sched.handoff_failed("r")  # recomputed here: it waits
    assert sched.num_waiting == 1
    assert pull_room(sched, settings(Role.COMPLETION), held=1) == 7
    probe = Request("p", list(range(20)), PARAMS)
    assert sched.admit_handoff(probe, [7]) is not None  # as the scheduler would


def test_a_completion_engine_pulls_none_its_scheduler_would_refuse_for_a_recompute():
    # Pulled beside a recompute that needs the room, each was parked, handed back a
    # second later, and pulled again: a handoff another decoder could have started.
    sched = scheduler(EngineType.COMPLETION, max_num_seqs=8, num_blocks=128)
    request = Request("r", list(range(1_900)), PARAMS)  # 119 of 128 blocks to come
    assert sched.admit_handoff(request, [7]) is not None
    sched.handoff_failed("r")
    assert pull_room(sched, settings(Role.COMPLETION), held=1) == 0
    assert sched.admit_handoff(Request("p", list(range(20)), PARAMS), [7]) is None


def test_the_simulator_gives_its_engines_the_services_waiting_buffer():
    # The service lets two steps' budget wait; the simulator's pods let 16k wait
    # whatever their budget: at 1,024, eight times what a real engine would.
    from tandem.operator.scaling_policy import ScalingPolicy
    from tandem.sim import deployment as deploy
    from tandem.sim.pod import engine_settings

    small = deploy.role_setup(
        "normal", engine={"max_num_batched_tokens": 1024, "enable_chunked_prefill": True}
    )
    assert engine_settings(small).max_waiting_tokens == waiting_tokens(1024) == 2 * 1024
    # The autoscaler's default target is half the buffer of an 8k-context engine
    # (docs/autoscaling.md), the simulator's default.
    budget = deploy.role_setup("normal").engine.max_num_batched_tokens
    assert ScalingPolicy().target_queued_tokens_per_replica * 2 == waiting_tokens(budget)
