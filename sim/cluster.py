"""Cluster: the discrete-event simulation of one model's pods, queues and autoscaler.

    result = Cluster(config, requests).run()

Events, in time order: request arrivals (read from the sorted workload, not
queued up front), pod steps ending, KV transfers ending, pods getting ready,
autoscaler evaluations. Nothing happens between events, so idle time costs
nothing. Between the events it copies the real system:
- requests wait in one FIFO (the Redis prefill stream); pods pull what they
  have room for at the start of each turn, an idle pod at once (a blocked
  XREADGROUP), the longest-idle first;
- a PROMPT pod's prefilled request becomes a Handoff in a second FIFO (the
  decode stream), taken by COMPLETION pods with room; its KV then moves over
  the network (network.py) and the request decodes there;
- every `scrape_interval_s` the real autoscaler (tandem.operator.autoscaler.
  decide_all) sees each ready pod's PodSample through the real pod_load and
  the queues as a QueueState, and its decisions are applied the way
  operator/local_actuator.py applies them, through the same plan_resize: new
  pods start (ready after `startup_s`), surplus pods drain, starting ones
  first, then the least loaded. A role's first
  history is seeded as the Kubernetes operator seeds it (operator/scaling.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Sequence

from tandem.engine.admission import PromptTooLongError, check_fits
from tandem.engine.config import EngineType
from tandem.engine.request import Request, RequestStatus
from tandem.operator.autoscaler import Decision, RoleObservation, ScalingHistory, decide_all
from tandem.operator.pod_load import pod_load
from tandem.operator.role_name import RoleName
from tandem.operator.scaling import plan_resize
from tandem.queue_state import QueueState
from tandem.sim.cluster_config import ClusterConfig
from tandem.sim.network import Links
from tandem.sim.pod import Handoff, Pod, PodState, engine_settings, sampling
from tandem.sim.records import (
    PodLife,
    ReplicaPoint,
    ReplicaTimeline,
    RequestRecord,
    RunResult,
    ScaleEvent,
)
from tandem.trace import TraceRequest

# Event kinds. Arrivals are read from the sorted workload, never pushed on the heap.
_ARRIVAL, _STEP, _TRANSFER, _READY, _TICK = range(5)
_RUNNING, _HANDOFF = RequestStatus.RUNNING, RequestStatus.HANDOFF


class Cluster:
    def __init__(self, config: ClusterConfig, requests: Sequence[TraceRequest]) -> None:
        self.config = config
        self._requests = list(requests)
        if any(a.arrival_s > b.arrival_s for a, b in itertools.pairwise(self._requests)):
            raise ValueError("requests must be sorted by arrival_s")
        self.records = [
            RequestRecord(r.arrival_s, r.input_tokens, r.output_tokens) for r in requests
        ]
        self._outstanding = len(self.records)
        self._heap: list[tuple[float, int, int, object]] = []
        self._serial = itertools.count()
        self._prefill_queue: deque[int] = deque()
        self._queued_tokens = 0
        self._handoffs: deque[Handoff] = deque()
        self._links = Links(config.network)
        self._roles = dict(config.deployment.roles)
        self._pods: dict[RoleName, list[Pod]] = {role: [] for role in self._roles}
        # Ready pods waiting for work or a report, longest-waiting first (dicts keep order).
        self._idle: dict[RoleName, dict[Pod, None]] = {role: {} for role in self._roles}
        self._replicas = {role: setup.replicas for role, setup in self._roles.items()}
        # Filled at a role's first evaluation (see _tick).
        self._histories: dict[RoleName, ScalingHistory] = {}
        self._costs = {role: config.cost_model(setup.tp) for role, setup in self._roles.items()}
        self._blocks = {role: config.kv_blocks(setup) for role, setup in self._roles.items()}
        self._settings = {role: engine_settings(setup) for role, setup in self._roles.items()}
        self._lives: list[PodLife] = []
        self._events: list[ScaleEvent] = []
        self._timeline = ReplicaTimeline()
        self._steps = 0
        self._tokens = 0
        self._names = itertools.count(1)

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        started = time.perf_counter()
        cfg = self.config
        for role, count in self._replicas.items():
            for _ in range(count):
                self._spawn(role, 0.0, ready_at=0.0)
        if cfg.deployment.autoscaled:
            self._push(cfg.scrape_interval_s, _TICK, None)
        self._record_replicas(0.0)
        requests, heap = self._requests, self._heap
        n, i, now = len(requests), 0, 0.0
        until = cfg.until_s if cfg.until_s is not None else 0.0
        end: float | None = None
        worked = 0.0  # the last event other than a tick: a run ends there, not at a tick
        while True:
            next_arrival = requests[i].arrival_s if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                t, _, kind, obj = heapq.heappop(heap)
            elif i < n:
                t, kind, obj = next_arrival, _ARRIVAL, i
                i += 1
            else:
                break
            if t > cfg.max_time_s:
                end = cfg.max_time_s
                break
            now = t
            if kind != _TICK:
                worked = now
            if kind == _STEP:
                self._step_done(obj, now)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                self._arrive(obj, now)  # type: ignore[arg-type]
            elif kind == _TRANSFER:
                self._transfer_done(obj, now)  # type: ignore[arg-type]
            elif kind == _READY:
                self._ready(obj, now)  # type: ignore[arg-type]
            else:
                self._tick(now)
                if i < n or self._outstanding or now + cfg.scrape_interval_s <= until:
                    self._push(now + cfg.scrape_interval_s, _TICK, None)
        if end is None:
            # Autoscaled, the tick pushed while work was left ran after the last answer:
            # its pods were billed to it, a fixed deployment's to the last answer.
            end = min(max(worked, until), cfg.max_time_s)
        self._record_replicas(end, always=True)
        for pods in self._pods.values():
            for pod in pods:
                self._lives.append(pod.life(end))
                pod.close()
        return RunResult(
            records=self.records,
            pods=self._lives,
            scale_events=self._events,
            timeline=self._timeline.points,
            end_s=end,
            steps=self._steps,
            wall_s=time.perf_counter() - started,
            tokens=self._tokens,
        )

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._serial), kind, obj))

    # --------------------------------------------------------------- events

    def _arrive(self, index: int, now: float) -> None:
        self._prefill_queue.append(index)
        self._queued_tokens += self.records[index].input_tokens
        role = RoleName.NORMAL if RoleName.NORMAL in self._roles else RoleName.PREFILL
        self._wake(role, self._prefill_queue, now)

    def _wake(self, role: RoleName, queue: deque, now: float) -> None:
        for pod in list(self._idle[role]):
            if not queue:
                return
            self._turn(pod, now)

    def _step_done(self, pod: Pod, now: float) -> None:
        self._steps += 1
        is_prefill, outputs = pod.end_step(now)
        records = self.records
        for rank, outs in enumerate(outputs):
            if is_prefill:
                for out in outs:
                    rec = records[int(out.request_id)]
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    self._tokens += len(out.new_token_ids)
                    if out.status is not _RUNNING:
                        self._ended(pod, rank, out.request_id, out.status, now)
            else:
                self._tokens += len(outs)
                for out in outs:
                    if out.status is not _RUNNING:
                        self._ended(pod, rank, out.request_id, out.status, now)
        self._turn(pod, now)

    def _ended(self, pod: Pod, rank: int, rid: str, status: RequestStatus, now: float) -> None:
        rec = self.records[int(rid)]
        if status is _HANDOFF:
            self._handoffs.append(
                Handoff(rid, pod, rank, rec.input_tokens, rec.output_tokens, rec.input_tokens)
            )
            self._wake(RoleName.DECODE, self._handoffs, now)
            return
        rec.finish_s = now
        # The scheduler ends a request whose context reaches max_model_len
        # (Scheduler._register caps its max_num_tokens there).
        rec.generated_tokens = min(rec.output_tokens, pod.config.max_model_len - rec.input_tokens)
        self._outstanding -= 1

    def _transfer_done(self, job: tuple[Pod, int, Handoff], now: float) -> None:
        pod, rank, handoff = job
        pod.received[rank].append(handoff.request_id)
        handoff.source.released[handoff.source_rank].append(handoff.request_id)
        for waiting in (pod, handoff.source):
            if waiting.state is not PodState.GONE and not waiting.busy:
                self._turn(waiting, now)

    def _ready(self, pod: Pod, now: float) -> None:
        if pod.state is PodState.STARTING:
            pod.state = PodState.READY
            self._record_replicas(now)  # at once: the next tick's point came late
        if pod.state is PodState.READY:
            self._turn(pod, now)

    # ----------------------------------------------------------------- pods

    def _turn(self, pod: Pod, now: float) -> None:
        """One turn of the pod's worker loop: absorb, pull, step (or wait)."""
        if pod.busy or pod.state is PodState.GONE or pod.state is PodState.STARTING:
            return
        for rank, handoff in pod.absorb():
            self._admit(pod, rank, handoff, now)
        took = pod.state is PodState.READY and self._pull(pod, now)
        if pod.state is not PodState.READY and pod.idle():  # draining and done
            self._retire(pod, now)
            return
        # The engine's metrics after its step and pull; the next step's prompts
        # count as waiting until it ends, as the engine's gauge counts them.
        pod.observe_waiting(now)
        role = pod.setup.role
        if pod.has_unfinished():
            seconds = pod.begin_step(now)
            if seconds is not None:
                self._idle[role].pop(pod, None)
                self._push(now + seconds, _STEP, pod)
                return
        if took:  # behind the pods idle longer (it kept its place, and took the next too)
            self._idle[role].pop(pod, None)
        self._idle[role][pod] = None

    def _pull(self, pod: Pod, now: float) -> bool:
        """Whether the pod took work from its queue."""
        completion = pod.engine_type is EngineType.COMPLETION
        queue = self._handoffs if completion else self._prefill_queue
        if not queue:
            return False
        took = False
        for rank in pod.pull_order():
            room = pod.room(rank)
            while room > 0 and queue:
                room -= 1
                took = True
                if not completion:
                    self._add(pod, rank, queue.popleft(), now)
                elif not self._admit(pod, rank, queue.popleft(), now):
                    return took  # parked: the engine hands the rest of its pull back at once
        return took

    def _add(self, pod: Pod, rank: int, index: int, now: float) -> None:
        rec = self.records[index]
        self._queued_tokens -= rec.input_tokens
        config = pod.config
        try:  # the engine's admission, before a prompt of that length is allocated
            check_fits(config, rec.input_tokens, rec.output_tokens, exact_max_tokens=False)
        except PromptTooLongError:  # the engine refuses it through the response stream
            rec.failure = (
                f"prompt over {config.prompt_limit} tokens, the engines' limit "
                f"(max_model_len {config.max_model_len} less one)"
            )
            rec.failed_s = now
            self._outstanding -= 1
            return
        request = Request(
            str(index), [0] * rec.input_tokens, sampling(rec.output_tokens), arrival_time=0.0
        )
        pod.ranks[rank].add_request(request)

    def _admit(self, pod: Pod, rank: int, handoff: Handoff, now: float) -> bool:
        """Admit a handoff and start its KV's transfer; False: parked without room."""
        if not pod.admit(rank, handoff):
            return False  # in the waiting room until the next turn
        source = handoff.source
        lanes = min(source.setup.tp, pod.setup.tp)
        size = handoff.num_kv_tokens * self.config.shape.kv_bytes_per_token / lanes
        end = self._links.reserve(source.name, pod.name, size, now)
        self._push(end, _TRANSFER, (pod, rank, handoff))
        return True

    def _spawn(self, role: RoleName, now: float, ready_at: float) -> Pod:
        setup = self._roles[role]
        pod = Pod(
            f"{role}-{next(self._names)}",
            setup,
            self._blocks[role],
            self._costs[role].plan_seconds,
            self._settings[role],
            created_at=now,
            ready_at=ready_at,
            min_step_s=max(self.config.device.step_overhead_s, 1e-4),
        )
        self._pods[role].append(pod)
        if pod.state is not PodState.STARTING:
            self._idle[role][pod] = None
        # Its first turn, even when it is ready at once (--startup-s 0): a pod spawned
        # for work already queued waited for the next arrival, and from zero for ever.
        self._push(ready_at, _READY, pod)
        return pod

    def _retire(self, pod: Pod, now: float) -> None:
        pod.state = PodState.GONE
        role = pod.setup.role
        self._idle[role].pop(pod, None)
        self._pods[role].remove(pod)
        self._lives.append(pod.life(now))
        self._links.forget(pod.name)
        pod.close()
        self._record_replicas(now)

    # ------------------------------------------------------------ autoscaler

    def _tick(self, now: float) -> None:
        observed = {}
        for role, pods in self._pods.items():
            loads = []
            for pod in pods:
                if pod.state is PodState.READY:  # a starting pod does not answer a scrape
                    sample = pod.sample(now)
                    loads.append(pod_load(sample, pod.last_sample))
                    pod.last_sample = sample
            observed[role] = RoleObservation(self._replicas[role], tuple(loads))
        policies = {role: setup.policy for role, setup in self._roles.items()}
        for role, replicas in self._replicas.items():
            # As the operator and `tandem up -f` do: a role seen for the first time
            # counts its replicas as recommended now in both windows, so nothing
            # scales before a whole window of evidence.
            self._histories.setdefault(role, ScalingHistory.starting(now, replicas))
        decisions = decide_all(observed, self._queue_state(), policies, self._histories, now)
        for role, decision in decisions.items():
            self._histories[role] = decision.history
            if decision.changed:
                self._resize(role, decision, now)
        self._record_replicas(now)

    def _queue_state(self) -> QueueState:
        pending = handoff_pending = 0
        for pods in self._pods.values():
            for pod in pods:
                held = sum(pod.held(r) for r in range(len(pod.ranks)))
                if pod.engine_type is EngineType.COMPLETION:
                    handoff_pending += held
                else:
                    pending += held
        return QueueState(
            waiting={0: len(self._prefill_queue)},
            pending=pending,
            queued_tokens=self._queued_tokens,
            handoff_waiting=len(self._handoffs),
            handoff_pending=handoff_pending,
        )

    def _resize(self, role: RoleName, decision: Decision, now: float) -> None:
        """What operator/local_actuator.py does with a decision, with pods for processes."""
        self._events.append(
            ScaleEvent(now, str(role), decision.current, decision.replicas, decision.reason)
        )
        self._replicas[role] = decision.replicas
        active = [p for p in self._pods[role] if p.active]
        start, drain = plan_resize(
            decision.replicas,
            [None if p.state is PodState.STARTING else p.last_sample for p in active],
        )
        for _ in range(start):
            self._spawn(role, now, ready_at=now + self.config.startup_s)
        for i in drain:  # starting pods first, then the least loaded
            pod = active[i]
            if pod.state is PodState.STARTING:
                self._retire(pod, now)
            else:
                pod.state = PodState.DRAINING
                self._turn(pod, now)

    def _record_replicas(self, now: float, *, always: bool = False) -> None:
        for role, pods in self._pods.items():
            states = [p.state for p in pods]
            ready, starting = states.count(PodState.READY), states.count(PodState.STARTING)
            draining = states.count(PodState.DRAINING)
            point = ReplicaPoint(now, str(role), self._replicas[role], ready, starting, draining)
            self._timeline.record(point, always=always)


def simulate(config: ClusterConfig, requests: Sequence[TraceRequest]) -> RunResult:
    return Cluster(config, requests).run()
