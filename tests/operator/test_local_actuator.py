"""`tandem up -f`'s actuator on its own: engines that die come back with backoff under
their own id, and what it does (or holds back from doing) is said once. Real Redis
and engine processes."""

import os
import re
import sys
import time

import pytest

from tandem.child import engine_threads
from tandem.operator.autoscaler import Decision, ScalingHistory
from tandem.operator.local_actuator import LocalActuator, load_manifest
from tandem.operator.pod_load import PodSample
from tandem.operator.role_name import RoleName

pytestmark = pytest.mark.timeout(60)


def _manifest(**normal):
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"path": "random:tiny"},
            "engine": {"maxModelLen": 256, "kvCacheMemory": "1Mi", "dtype": "float32"},
            "normal": {"minReplicas": 1, "maxReplicas": 3, **normal},
        },
    }


def _flag(argv, name):
    (value,) = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"--{name}=")]
    return value


@pytest.fixture
def actuator(redis_url, keys, tmp_path):
    made = []

    def make(manifest, extra_engine_args=()):
        name, spec = load_manifest(manifest)
        said = []
        actuator = LocalActuator(
            name,
            spec,
            redis_url=redis_url,
            log_dir=tmp_path,
            keys=keys,
            extra_engine_args=extra_engine_args,
            say=said.append,
        )
        made.append(actuator)
        return actuator, said

    yield make
    for actuator in made:
        for child in actuator.children():
            child.kill()
        actuator.close()


def test_an_engine_that_cannot_start_is_restarted_with_backoff_under_its_own_id(actuator):
    local, said = actuator(_manifest(), extra_engine_args=("--no-such-flag",))
    (child,) = local.start()
    assert said == [f"normal-1   starting (log {child.log_path})"]
    child.process.wait(timeout=30)  # `tandem engine` refuses the flag at once
    local.supervise()
    assert said[1].startswith("normal-1 exited (2: ") and "--no-such-flag" in said[1]
    assert said[1].endswith("; restarting in 1s")
    first = child.process
    for _ in range(3):  # within its backoff: not started again, nothing more said
        local.supervise()
    assert child.process is first and len(said) == 2
    child.next_start = time.monotonic()  # the backoff is over
    local.supervise()
    # The same engine (its id: its predecessor's pending requests are its own), not another.
    assert local.children() == [child] and child.process is not first
    [engine_id] = [a for a in child.argv if a.startswith("--engine-id=")]
    # This stack's own (a run id: two stacks on one Redis never share an id), serial 1.
    assert re.fullmatch(r"--engine-id=tiny-normal-[0-9a-f]{6}-1", engine_id)
    child.process.wait(timeout=30)
    local.supervise()
    assert said[-1].endswith("; restarting in 2s")  # a crash loop backs off further


def test_an_engine_that_cannot_be_started_is_tried_again_not_forgotten(actuator, tmp_path):
    # A scale-up whose engine could not be started (no fork, its log refused) ended the
    # whole stack, or left the role an engine short for good: its count said 2.
    local, said = actuator(_manifest())
    local.start()
    (tmp_path / "engine-normal-2.log").mkdir()  # the next engine's log cannot be opened
    local.replicas[RoleName.NORMAL] = 2  # what a scale-up decided
    local.supervise()
    assert said[-1].startswith("normal engine could not start: [Errno 21]")
    assert said[-1].endswith("; trying again in 1s")
    assert len(local.active(RoleName.NORMAL)) == 1
    local.supervise()  # within its backoff: nothing tried, nothing said
    assert len(said) == 2
    time.sleep(1.1)
    local.supervise()
    assert said[-1].startswith("normal-3   starting")
    assert len(local.active(RoleName.NORMAL)) == 2


def test_a_scale_up_held_by_its_window_is_said_once(actuator, redis_client, keys):
    local, said = actuator(
        _manifest(targetQueuedTokensPerReplica=100, scaleUpStabilizationSeconds=60)
    )
    # 1,000 prompt tokens queued ask for 10 engines; no engine runs (none started).
    redis_client.set(keys.queued_tokens("tiny"), 1000)
    redis_client.xadd(keys.work_streams("tiny")[0], {"r": "1"})
    reasons = []
    for tokens in (1000, 990, 980):  # the same ask, 10 engines, in other numbers
        redis_client.set(keys.queued_tokens("tiny"), tokens)
        (decision,) = local.evaluate().values()
        assert decision.replicas == 1 and decision.recommendation == 10
        reasons.append(decision.reason)
    assert len(set(reasons)) > 1, reasons
    assert said == [f"hold {reasons[0]} (the signals ask for 10)"]
    assert "scale-up held at 1 by the 60s window" in said[0]
    assert local.replicas == {RoleName.NORMAL: 1}


def test_a_stopping_stack_starts_a_role_at_zero_and_nothing_more(actuator, redis_client, keys):
    # While `tandem up` answered what it had admitted, each evaluation could still scale
    # up: engines, each a model's load, started only to be drained once up.
    busy = _manifest(targetQueuedTokensPerReplica=100, scaleUpStabilizationSeconds=0)
    local, said = actuator(busy)
    redis_client.set(keys.queued_tokens("tiny"), 1000)  # asks for 3 (the most)
    redis_client.xadd(keys.work_streams("tiny")[0], {"r": "1"})
    (decision,) = local.evaluate(stopping=True).values()
    assert decision.replicas == 3 and local.replicas == {RoleName.NORMAL: 1}
    assert said == []
    idle, _ = actuator(_manifest(minReplicas=0, replicas=0, scaleUpStabilizationSeconds=0))
    idle.evaluate(stopping=True)  # the queued request has no engine at all: one starts
    assert idle.replicas == {RoleName.NORMAL: 1}


# Answers /healthz and /readyz, but its metrics fail: an engine up and unreadable.
_UNREADABLE_ENGINE = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(500 if self.path == "/metrics" else 200)
        self.end_headers()
    def log_message(self, *args):
        pass  # no access log: the test reads nothing of it
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_an_engine_up_whose_metrics_fail_is_unreadable_not_starting(actuator):
    # Counted as starting, a role whose scrapes all time out under load froze at its
    # size; the operator counts such a pod unreadable, and so must `tandem up -f`.
    local, _ = actuator(_manifest())
    (child,) = local.start()
    child.kill()
    (engine,) = local.engines[RoleName.NORMAL]
    child.argv = [sys.executable, "-c", _UNREADABLE_ENGINE, str(engine.http_port)]
    child.start()
    deadline = time.monotonic() + 20
    while not child.started_up and time.monotonic() < deadline:
        child.hung(time.monotonic())  # the liveness probe, as supervise() asks it
        time.sleep(0.2)
    assert child.started_up
    (decision,) = local.evaluate().values()
    assert decision.unreadable is not None and "holding" in decision.reason


def test_a_drained_engine_that_exits_is_said_to_have_stopped(actuator):
    # It was said to be draining, then nothing: had it stopped, or hung?
    local, said = actuator(_manifest())
    (child,) = local.start()
    (engine,) = local.engines[RoleName.NORMAL]
    engine.draining, local.replicas[RoleName.NORMAL] = True, 0  # as a scale-down leaves it
    child.process.terminate()
    child.process.wait(timeout=30)
    local.supervise()
    assert said[-1] == "normal-1   drained and stopped"
    assert local.engines[RoleName.NORMAL] == []


def test_a_pods_cpu_limit_does_not_give_local_engines_more_threads_than_their_share(
    actuator, monkeypatch
):
    # A manifest written for a cluster asks 8 CPUs a pod; here the engines share
    # this machine's cores, as many engines as the role may scale to.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    manifest = _manifest(resources={"limits": {"cpu": "8"}})
    local, _ = actuator(manifest)
    (child,) = local.start()
    assert _flag(child.argv, "threads") == str(engine_threads(3))  # maxReplicas 3, not 8


def test_a_cpu_limit_below_the_share_still_bounds_a_local_engine(actuator, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    manifest = _manifest(resources={"limits": {"cpu": "2"}})
    local, _ = actuator(manifest)
    (child,) = local.start()
    assert _flag(child.argv, "threads") == "2"  # not 63 // 3


def test_what_a_manifest_asks_of_a_cluster_is_said_unused_here(actuator):
    # A pinned image, a GPU, a node: silently run as the local CPU engine.
    manifest = _manifest(
        nodeSelector={"gpu": "h100"},
        resources={"limits": {"cpu": "2", "nvidia.com/gpu": "1"}, "requests": {"memory": "1Gi"}},
    )
    manifest["spec"]["image"] = "ghcr.io/x/engine:1"
    local, said = actuator(manifest)
    local.start()
    assert said[0] == (
        "cluster    not used on one machine: spec.image, spec.normal.nodeSelector, "
        # Beside a GPU limit the CPU limit sizes nothing (a GPU pod's threads are torch's).
        "spec.normal.resources.limits.cpu, spec.normal.resources.limits.nvidia.com/gpu, "
        "spec.normal.resources.requests.memory"
    )
    plain, said = actuator(_manifest())
    plain.start()
    assert not said[0].startswith("cluster")


def test_a_scale_down_stops_an_engine_that_died_not_the_one_serving(actuator):
    # Ranked by its reading from before it died (12 requests running), a crashed engine
    # was kept and the idle live one drained: the role served nothing until the dead one
    # had restarted (a whole model load; for good in a crash loop).
    local, _ = actuator(_manifest())
    local.replicas[RoleName.NORMAL] = 2
    local.start()
    dead, serving = local.engines[RoleName.NORMAL]
    dead.child.kill()
    dead.last_sample = PodSample("normal-1", True, 0.0, 0.9, 12, 0, 0, 8192)
    serving.last_sample = PodSample("normal-2", True, 0.0, 0.1, 0, 0, 0, 8192)
    serving.read_now = True
    history = ScalingHistory()
    local._resize(RoleName.NORMAL, Decision(RoleName.NORMAL, 1, 2, 1, "scale 2->1", history))
    assert (dead.draining, serving.draining) == (True, False)


def test_a_scale_down_keeps_a_busy_engine_whose_scrape_failed(actuator):
    # Unread this time (its scrape timed out under load), it was ranked as an engine
    # that hung and stopped first; it answers its liveness probe, and the operator ranks
    # such a pod by its last sample.
    local, _ = actuator(_manifest())
    local.replicas[RoleName.NORMAL] = 2
    local.start()
    busy, idle = local.engines[RoleName.NORMAL]
    busy.last_sample = PodSample("normal-1", True, 0.0, 0.9, 12, 0, 0, 8192)
    idle.last_sample = PodSample("normal-2", True, 0.0, 0.1, 0, 0, 0, 8192)
    busy.read_now, idle.read_now = False, True
    busy.child._was_live = True  # it answered /healthz: up, not hung
    history = ScalingHistory()
    local._resize(RoleName.NORMAL, Decision(RoleName.NORMAL, 1, 2, 1, "scale 2->1", history))
    assert (busy.draining, idle.draining) == (False, True)
