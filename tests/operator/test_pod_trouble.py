"""Why engine pods are not ready, read from pod status as the kubelet writes it."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.pod_trouble import pod_trouble, role_trouble
from tandem.operator.role_name import RoleName
from tandem.operator.status import RoleCounts, valid_status
from tandem.operator.status_model import Phase

ENGINE_ERROR = (
    "INFO loading model\n"
    "tandem: error: 64 KV blocks of 16 tokens hold 1024 tokens, fewer than one sequence "
    "of max_model_len 2048: give the cache more blocks or lower max_model_len\n"
)


def pod(name: str = "m-normal-abc-1", *, engine: dict[str, Any] | None = None, **status: Any):
    containers = [] if engine is None else [{"name": "engine", "ready": False, **engine}]
    return {
        "metadata": {"name": name, "labels": {"serving.tandem.dev/role": "normal"}},
        "status": {"phase": "Running", "containerStatuses": containers, **status},
    }


def crash_loop(message: str = ENGINE_ERROR, reason: str = "Error", code: int = 1) -> dict:
    return {
        "restartCount": 4,
        "image": "ghcr.io/tandem/engine:1",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
        "lastState": {"terminated": {"exitCode": code, "reason": reason, "message": message}},
    }


def test_an_engine_that_keeps_exiting_is_quoted_in_its_own_words():
    trouble = pod_trouble(pod(engine=crash_loop()))
    assert trouble is not None and trouble.reason == "EngineCrashLoop" and trouble.degrades
    assert "pod m-normal-abc-1: the engine exits with code 1 (4 restarts)" in trouble.message
    assert "fewer than one sequence of max_model_len 2048" in trouble.message


def test_a_model_download_that_keeps_failing_is_quoted_before_the_waiting_engine():
    fetch = {"name": "fetch-model", **crash_loop("401 Client Error: gated repo")}
    waiting = {"state": {"waiting": {"reason": "PodInitializing"}}}
    trouble = pod_trouble(pod(engine=waiting, initContainerStatuses=[fetch]))
    assert trouble is not None and trouble.reason == "ModelFetchFailing"
    assert "init container fetch-model exits with code 1" in trouble.message
    assert "gated repo" in trouble.message


def test_a_model_download_that_failed_then_finished_is_no_trouble():
    # Two 429s, then the weights: the pod read ModelFetchFailing for the rest of its life,
    # and a rollout or a lost pod later blamed it (over another pod's real trouble).
    fetched = {
        "name": "fetch-model",
        **crash_loop("huggingface_hub: 429 Too Many Requests"),
        "restartCount": 2,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
    }
    loading = {"restartCount": 0, "state": {"running": {}}}
    assert pod_trouble(pod(engine=loading, initContainerStatuses=[fetched])) is None


def test_a_crash_loop_holds_between_its_back_offs():
    # Running again after its third exit, not ready yet: still the same loop.
    engine = {**crash_loop(), "restartCount": 3, "state": {"running": {}}}
    trouble = pod_trouble(pod(engine=engine))
    assert trouble is not None and trouble.reason == "EngineCrashLoop"


def test_an_engine_up_since_its_last_exits_is_not_in_a_crash_loop():
    # Two exits at start (Redis not up yet), then hours of serving; a Redis blip made
    # it unready, and the model read EngineCrashLoop, quoting the hours-old log.
    engine = {**crash_loop(), "restartCount": 2, "state": {"running": {}}, "started": True}
    assert pod_trouble(pod(engine=engine)) is None
    looping = {**engine, "started": False}  # loading again, its probe not passed yet
    trouble = pod_trouble(pod(engine=looping))
    assert trouble is not None and trouble.reason == "EngineCrashLoop"


def test_a_crash_without_a_message_points_at_the_logs():
    trouble = pod_trouble(pod(engine=crash_loop(message="")))
    assert trouble is not None and "kubectl logs --previous" in trouble.message


def test_a_redis_password_in_the_log_is_not_quoted():
    # Everyone who may `get` the model reads its status; fewer may read the pod's log.
    said = "tandem: error: cannot reach Redis at redis://:S3cret@redis:6379/0 (--redis-url)"
    trouble = pod_trouble(pod(engine=crash_loop(message=said)))
    assert trouble is not None and "S3cret" not in trouble.message
    assert "redis://:***@redis:6379/0" in trouble.message


def test_a_long_log_tail_is_cut_to_its_last_lines():
    tail = "\n".join(f"line {i}" for i in range(80)) + "\n" + "x" * 2000
    trouble = pod_trouble(pod(engine=crash_loop(message=tail)))
    assert trouble is not None and len(trouble.message) < 800
    assert trouble.message.endswith("x" * 100) and "line 0" not in trouble.message


def test_an_engine_killed_for_memory_says_which_limit():
    trouble = pod_trouble(pod(engine=crash_loop(message="", reason="OOMKilled", code=137)))
    assert trouble is not None and trouble.reason == "EngineOOMKilled"
    assert "resources.limits.memory" in trouble.message


@pytest.mark.parametrize(
    "reason",
    [
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ImageInspectError",
    ],
)
def test_an_image_that_cannot_be_pulled(reason):
    waiting = {"reason": reason, "message": 'pull access denied for "ghcr.io/tandem/enigne"'}
    engine = {"image": "ghcr.io/tandem/enigne:1", "state": {"waiting": waiting}}
    trouble = pod_trouble(pod(engine=engine))
    assert trouble is not None and trouble.reason == "ImagePullFailing"
    assert "ghcr.io/tandem/enigne:1 cannot be pulled: pull access denied" in trouble.message


def test_an_image_never_pulled_says_the_node_lacks_it():
    waiting = {"reason": "ErrImageNeverPull", "message": "Container image is not present"}
    trouble = pod_trouble(pod(engine={"image": "engine:dev", "state": {"waiting": waiting}}))
    assert trouble is not None and "imagePullPolicy is Never" in trouble.message


def test_a_missing_secret_stops_the_container_before_it_starts():
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "redis" not found'}
    trouble = pod_trouble(pod(engine={"state": {"waiting": waiting}}))
    assert trouble is not None and trouble.reason == "ContainerConfigError"
    assert 'secret "redis" not found' in trouble.message


def test_an_unschedulable_pod_waits_with_the_scheduler_s_reason():
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
    trouble = pod_trouble(pod(conditions=[condition], phase="Pending"))
    assert trouble is not None and trouble.reason == "Unschedulable" and not trouble.degrades
    assert "3 Insufficient nvidia.com/gpu" in trouble.message


@pytest.mark.parametrize(
    "engine",
    [
        {"state": {"waiting": {"reason": "ContainerCreating"}}},
        {"state": {"running": {"startedAt": "2026-12-02T00:00:00Z"}}},  # loading the model
        # Exited once, restarting now: not a loop yet.
        {"restartCount": 1, "state": {"running": {}}, "lastState": {"terminated": {"exitCode": 1}}},
        {"ready": True, "state": {"running": {}}},
    ],
)
def test_a_pod_that_is_starting_or_ready_has_no_trouble(engine):
    assert pod_trouble(pod(engine=engine)) is None


def test_a_pod_being_deleted_has_no_trouble():
    leaving = pod(engine=crash_loop())
    leaving["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    assert pod_trouble(leaving) is None


def test_an_evicted_pod_left_behind_has_no_trouble():
    # It lingers (Failed) until the cluster's terminated-pod threshold: every later
    # scale-up read its old OOM kill and called the model Degraded.
    evicted = pod(
        engine={"restartCount": 2, "lastState": {"terminated": {"reason": "OOMKilled"}}},
        phase="Failed",
        reason="Evicted",
        message="The node was low on resource: memory.",
    )
    assert pod_trouble(evicted) is None


def test_a_role_reports_its_first_troubled_pod_by_name():
    pods = [pod("m-b", engine=crash_loop()), pod("m-c"), pod("m-a", engine=crash_loop("boom"))]
    trouble = role_trouble(pods)
    assert trouble is not None and "pod m-a" in trouble.message and "boom" in trouble.message
    assert role_trouble([pod("m-c")]) is None


META = {"generation": 1}
NOW = "2026-12-02T00:00:00Z"


def _status(ready: int, trouble_pod: dict, previous: dict | None = None) -> dict:
    counts = RoleCounts(desired=2, replicas=2, ready=ready, trouble=role_trouble([trouble_pod]))
    return valid_status(META, {RoleName.NORMAL: counts}, previous or {}, NOW)


def test_a_crash_loop_degrades_a_new_model_and_the_status_quotes_it():
    status = _status(0, pod(engine=crash_loop()))
    assert (status["phase"], status["reason"]) == (Phase.DEGRADED.value, "EngineCrashLoop")
    assert status["message"].startswith("normal: pod m-normal-abc-1: the engine exits")
    assert status["message"].endswith("normal 0/2 ready")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and "max_model_len 2048" in degraded["message"]


def test_an_unschedulable_pod_leaves_the_model_pending_with_the_reason():
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    status = _status(0, pod(conditions=[condition]))
    assert (status["phase"], status["reason"]) == (Phase.PENDING.value, "Unschedulable")
    status = _status(1, pod(conditions=[condition]))
    assert (status["phase"], status["reason"]) == (Phase.PROGRESSING.value, "Unschedulable")


def test_a_troubled_pod_of_a_role_with_all_its_pods_ready_changes_nothing():
    counts = RoleCounts(
        desired=2, replicas=3, ready=2, trouble=role_trouble([pod(engine=crash_loop())])
    )
    status = valid_status(META, {RoleName.NORMAL: counts}, {}, NOW)
    assert status["phase"] == Phase.READY.value


def test_a_model_whose_crash_is_over_is_starting_not_degraded():
    # It never served: once its pods stop crashing it is starting, not "lost pods".
    previous = _status(0, pod(engine=crash_loop()))
    previous["roles"] = {"normal": {"desired": 2}}
    counts = RoleCounts(desired=2, replicas=2, ready=0)
    status = valid_status(META, {RoleName.NORMAL: counts}, previous, NOW)
    assert (status["phase"], status["reason"]) == (Phase.PENDING.value, "PodsStarting")


def test_a_rollout_whose_new_pods_crash_is_degraded_while_the_old_still_serve():
    trouble = role_trouble([pod(engine=crash_loop())])
    counts = RoleCounts(desired=2, replicas=3, ready=2, rolling=True, trouble=trouble)
    status = valid_status(META, {RoleName.NORMAL: counts}, {"phase": "Ready"}, NOW)
    assert (status["phase"], status["reason"]) == (Phase.DEGRADED.value, "EngineCrashLoop")


def test_a_pods_message_past_the_crds_limit_is_cut_to_fit():
    # Its own words come from outside (the kubelet, an admission webhook's denial): a
    # status longer than the CRD's maxLength is refused whole, and never updated again.
    from tandem.operator.crd import status_schema

    limit = status_schema()["properties"]["message"]["maxLength"]
    waiting = {"reason": "ErrImagePull", "message": "denied: " + "x" * 100_000}
    status = _status(0, pod(engine={"image": "engine:1", "state": {"waiting": waiting}}))
    assert status["reason"] == "ImagePullFailing" and status["message"].startswith("normal: pod")
    assert len(status["message"]) == limit
    assert all(len(c["message"]) <= limit for c in status["conditions"])
