"""A narrated run of the step scheduler on the seed's worked examples.

`tandem walkthrough` prints it. The runner here is a stand-in that samples a
fixed token: what is shown is the scheduler's decisions, not a model.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.config import EngineConfig
from tandem.engine.plan import StepPlan, StepResult
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler


def _fake_result(plan: StepPlan) -> StepResult:
    return StepResult({s.request_id: [1] for s in plan.seqs if s.sample})


def _step(scheduler: Scheduler) -> StepPlan:
    plan = scheduler.schedule()
    scheduler.update(plan, _fake_result(plan))
    return plan


def attempt_points(say: Callable[[str], None]) -> None:
    say("1. ALL/ANY attempt points (one rank, intervals 70/100)")
    sched = Scheduler(EngineConfig(max_model_len=2048), num_blocks=1024)
    long_run = SamplingParams(max_tokens=10_000, ignore_eos=True)
    sched.add_request(Request("long", list(range(100)), long_run))
    _step(sched)  # its prefill
    while sched.decode_step < 5:
        _step(sched)
    say(f"   a long decode is running; decode_step = {sched.decode_step}: two requests arrive")
    sched.add_request(Request("new-1", list(range(200, 264)), long_run))
    sched.add_request(Request("new-2", list(range(300, 364)), long_run))
    waited = 0
    while True:
        counter = sched.decode_step
        plan = _step(sched)
        if plan.is_prefill:
            break
        waited += 1
    say(f"   {waited} decode steps later, at decode_step = {counter} (an ALL point), a prompt")
    prefilled = list(plan.num_scheduled_tokens)
    say(f"   step prefills {prefilled}; the counter is now {sched.decode_step}")
    say("   (with the defaults 256 seqs and budget 4,096 both prompts fit one step)")


def chunked_prefill(say: Callable[[str], None]) -> None:
    say("2. Chunked prefill: a 20,000-token prompt at budget 8,192")
    config = EngineConfig(
        max_model_len=32_768, max_num_batched_tokens=8192, enable_chunked_prefill=True
    )
    sched = Scheduler(config, num_blocks=4096)
    sched.add_request(Request("rag", list(range(20_000)), SamplingParams(max_tokens=4)))
    while True:
        plan = sched.schedule()
        seq = plan.seqs[0]
        outputs = sched.update(plan, _fake_result(plan))
        token = outputs[0].new_token_ids if outputs else "no token yet"
        say(f"   prefill chunk of {len(seq.token_ids):>5} tokens at {seq.start_pos:>5}: {token}")
        if seq.sample:
            break


def budget_default(say: Callable[[str], None]) -> None:
    config = EngineConfig(max_model_len=2048, max_num_seqs=256, num_speculative_tokens=5)
    say("3. The default budget: max(max_model_len, 4096, max_num_seqs x (1 + drafts))")
    say(f"   max(2048, 4096, 256 x 6 = 1536) = {config.max_num_batched_tokens}")


def run(say: Callable[[str], None] = print) -> None:
    for part in (attempt_points, chunked_prefill, budget_default):
        part(say)
        say("")
