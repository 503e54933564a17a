"""Pod: one simulated engine pod, the real Scheduler per data-parallel rank, timed by the model.

A step is planned by the real scheduler (every rank together when there are
several: lockstep.py), lasts what the cost model says the slowest rank's plan
costs, and is applied with scheduler.update() when it ends. The model's
sampled tokens are stand-ins (token 0, never a stop token), so a request ends
at its output length, as `tandem bench` requests with ignore_eos do.

What the engine service adds around the scheduler, from
engine/service/worker.py and handoff_flow.py, as rules the pod keeps:
- it pulls work only when it has room (`room` calls the service's `pull_room`);
- a COMPLETION pod holds handoffs it could not admit yet and retries them
  every turn (the waiting room); one it admits is decoded once its KV arrived;
- a PROMPT pod keeps a prefilled request's KV pinned until the transfer ends;
- reports (KV received, KV fetched) are absorbed at the start of a turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from tandem.engine.plan import RequestOutput, StepPlan, StepResult
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.service.room import pull_room
from tandem.engine.service.settings import WorkerSettings, waiting_tokens
from tandem.engine.service.time_integral import TimeIntegral
from tandem.operator.pod_load import PodSample
from tandem.sim.deployment import RoleSetup
from tandem.sim.lockstep import Lockstep
from tandem.sim.records import PodLife

# The token every simulated step samples: a list shared by every result, never mutated.
_TOKEN = [0]


def engine_settings(setup: RoleSetup) -> WorkerSettings:
    """The engine service's settings of a role's pods: what `tandem engine` would run
    them with (the waiting buffer from their budget, as serve.py sets it)."""
    return WorkerSettings(
        role=setup.role.engine_role,
        model_name="sim",
        engine_id="sim",
        http_address="",
        max_waiting_tokens=waiting_tokens(setup.engine.max_num_batched_tokens),
    )


class PodState(Enum):
    STARTING = "starting"  # scheduled, loading weights: holds its GPUs, takes no work
    READY = "ready"
    DRAINING = "draining"  # told to stop: takes no work, finishes what it holds
    GONE = "gone"


@dataclass(slots=True)
class Handoff:
    """A prefilled request waiting for a COMPLETION pod (an entry of the handoff stream)."""

    request_id: str
    # The PROMPT pod holding the KV, and its rank.
    source: Pod
    source_rank: int
    prompt_len: int
    output_tokens: int
    # KV tokens to move: the prompt (the first token's KV is computed by the decoder).
    num_kv_tokens: int


@dataclass(slots=True)
class Counters:
    """Running totals, as the engine's /metrics counters keep them."""

    steps: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    scheduled_tokens: dict[str, float] = field(
        default_factory=lambda: {"prefill": 0.0, "decode": 0.0}
    )
    step_seconds: float = 0.0


class Pod:
    def __init__(
        self,
        name: str,
        setup: RoleSetup,
        num_blocks: int,
        step_seconds: Callable[[StepPlan], float],
        settings: WorkerSettings,
        created_at: float,
        ready_at: float,
        min_step_s: float = 1e-3,
    ) -> None:
        self.name = name
        self.setup = setup
        self.config = setup.engine
        self.engine_type = setup.engine.engine_type
        self.settings = settings
        self._step_seconds = step_seconds
        # What a step of data-parallel ranks that all run nothing costs (votes, the loop).
        self._min_step_s = min_step_s
        dp = setup.dp
        self._lockstep = Lockstep(dp) if dp > 1 else None
        votes = [self._lockstep.vote(r) for r in range(dp)] if self._lockstep else [None]
        self.ranks = [Scheduler(setup.engine, num_blocks, vote=v) for v in votes]
        self.state = PodState.READY if ready_at <= created_at else PodState.STARTING
        self.created_at = created_at
        self.ready_at = ready_at
        self.gone_at: float | None = None
        # The plans of the step in flight (one per rank), empty between steps.
        self.plans: list[StepPlan] = []
        self.step_started_at = 0.0
        # Reports absorbed at the next turn, per rank: KV received / KV fetched from us.
        self.received: list[list[str]] = [[] for _ in range(dp)]
        self.released: list[list[str]] = [[] for _ in range(dp)]
        # COMPLETION: handoffs taken but not admitted yet (no room), per rank.
        self.waiting_room: list[list[Handoff]] = [[] for _ in range(dp)]
        self.counters = Counters()
        # The engine's waiting prompt tokens, integrated over time as its /metrics does.
        self.waiting_token_seconds = TimeIntegral(created_at)
        self.last_sample: PodSample | None = None
        # Rotates which rank pulls first, as concurrent XREADGROUPs would.
        self._first_rank = 0

    # ---------------------------------------------------------------- state

    @property
    def busy(self) -> bool:
        """A step is in flight."""
        return bool(self.plans)

    @property
    def active(self) -> bool:
        """Counted by the autoscaler (not draining, not gone)."""
        return self.state in (PodState.STARTING, PodState.READY)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.ranks)

    def held(self, rank: int) -> int:
        """Entries this rank took and has not acknowledged (worker.held)."""
        sched = self.ranks[rank]
        return len(sched.requests) - len(sched.handoff) + len(self.waiting_room[rank])

    def idle(self) -> bool:
        """Nothing left to do or to keep (a draining pod may go)."""
        return not any(
            s.requests or room for s, room in zip(self.ranks, self.waiting_room, strict=True)
        )

    def room(self, rank: int) -> int:
        """How many entries this rank pulls now: the engine service's own rule."""
        if self.state is not PodState.READY:
            return 0
        parked = len(self.waiting_room[rank])  # none pulled while some wait for room
        return pull_room(self.ranks[rank], self.settings, self.held(rank), parked)

    def pull_order(self) -> list[int]:
        n = len(self.ranks)
        first, self._first_rank = self._first_rank, (self._first_rank + 1) % n
        return [(first + i) % n for i in range(n)]

    # ---------------------------------------------------------------- steps

    def absorb(self) -> list[tuple[int, Handoff]]:
        """Apply the reports of KV moved; returns the waiting room's handoffs to retry."""
        retry = []
        for rank, sched in enumerate(self.ranks):
            for rid in self.received[rank]:
                sched.handoff_received(rid)
            for rid in self.released[rank]:
                sched.release_handoff(rid)
            self.received[rank].clear()
            self.released[rank].clear()
            if self.waiting_room[rank]:
                retry.extend((rank, h) for h in self.waiting_room[rank])
                self.waiting_room[rank].clear()
        return retry

    def admit(self, rank: int, handoff: Handoff) -> bool:
        """COMPLETION: reserve blocks for a handoff's KV, or keep it in the waiting room."""
        request = Request(
            handoff.request_id,
            [0] * handoff.prompt_len,
            sampling(handoff.output_tokens),
            arrival_time=0.0,
        )
        if self.ranks[rank].admit_handoff(request, list(_TOKEN)) is None:
            self.waiting_room[rank].append(handoff)
            return False
        return True

    def begin_step(self, now: float) -> float | None:
        """Plan a step; its seconds, or None when a lone rank has nothing it can run."""
        if self._lockstep is None:
            plan = self.ranks[0].schedule()
            if not plan.seqs:
                return None  # waits for a report or for work: nothing would change
            plans = [plan]
        else:
            plans = self._lockstep.schedule_all(self.ranks)
        seconds = max(self._min_step_s, *map(self._step_seconds, plans))
        self.plans = plans
        self.step_started_at = now
        return seconds

    def end_step(self, now: float) -> tuple[bool, list[list[RequestOutput]]]:
        """Apply the step in flight: whether it was a prompt step, and each rank's outputs."""
        plans, self.plans = self.plans, []
        is_prefill = plans[0].is_prefill
        kind = "prefill" if is_prefill else "decode"
        counters = self.counters
        counters.steps[kind] += 1
        counters.step_seconds += now - self.step_started_at
        outputs = []
        for sched, plan in zip(self.ranks, plans, strict=True):
            scheduled = plan.num_scheduled_tokens
            counters.scheduled_tokens[kind] += sum(scheduled.values())
            outputs.append(sched.update(plan, StepResult(dict.fromkeys(scheduled, _TOKEN))))
        return is_prefill, outputs

    # -------------------------------------------------------------- metrics

    def observe_waiting(self, now: float) -> None:
        """The prompt tokens waiting in the pod's ranks are what they are now, from now on."""
        self.waiting_token_seconds.set(sum(s.waiting_prompt_tokens for s in self.ranks), now)

    def sample(self, now: float) -> PodSample:
        """What a scrape of this pod's /metrics reads now (summed over its ranks)."""
        ranks = self.ranks
        return PodSample(
            pod=self.name,
            ready=self.state is PodState.READY,
            scraped_at=now,
            kv_cache_usage=sum(s.kv.usage for s in ranks) / len(ranks),
            requests_running=sum(len(s.running) for s in ranks),
            requests_waiting=sum(len(s.waiting) for s in ranks),
            waiting_prompt_tokens=sum(s.waiting_prompt_tokens for s in ranks),
            token_budget=self.config.max_num_batched_tokens * len(ranks),
            kv_pinned_requests=sum(len(s.handoff) for s in ranks),
            kv_receiving_requests=sum(len(s.receiving) for s in ranks),
            handoffs_parked=sum(len(room) for room in self.waiting_room),
            max_running_requests=self.config.max_running * len(ranks),
            steps_total=dict(self.counters.steps),
            scheduled_tokens_total=dict(self.counters.scheduled_tokens),
            step_seconds_total=self.counters.step_seconds,
            waiting_token_seconds_total=self.waiting_token_seconds.total(now),
            started_at=self.ready_at,
        )

    def life(self, end: float) -> PodLife:
        """The pod's record, gone at `end`."""
        setup = self.setup
        return PodLife(
            self.name, str(setup.role), setup.gpus_per_pod, self.created_at, self.ready_at, end
        )

    def close(self) -> None:
        if self._lockstep is not None:
            self._lockstep.close()


def sampling(max_tokens: int) -> SamplingParams:
    """A simulated request's parameters: it generates exactly max_tokens tokens."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
