"""The operator's autoscaling, peering and API-failure handling, against the emulated API.

Engine metrics and queue depths are fakes (conftest.FakeMetrics); the
autoscaler's clock is fake too, so the stabilisation window passes when the
test says so, while kopf's timer ticks every 0.2 s of real time.
"""

from __future__ import annotations

import asyncio
import logging
from base64 import b64encode
from typing import Any

import kmock
import pytest
from support.kube_api import DEPLOYMENTS, MODELS, PEERINGS, PODS, SECRETS
from support.kube_cluster import NAMESPACE, PEERING, eventually, normal_model

from tandem.operator.crd import custom_resource_definition
from tandem.operator.manifests import DELETION_COST_ANNOTATION
from tandem.operator.sources import MetricSources

pytestmark = pytest.mark.asyncio

WINDOW_S = 3  # scaleDownStabilizationSeconds of the test models (fake seconds)


def split(name: str = "m") -> dict[str, Any]:
    """A Disaggregated model whose roles both scale between 1 and 4 pods."""
    bounds = {
        "replicas": 1,
        "minReplicas": 1,
        "maxReplicas": 4,
        "scaleDownStabilizationSeconds": WINDOW_S,
    }
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "smollm2"},
            "mode": "Disaggregated",
            "prefill": {**bounds, "targetQueuedTokensPerReplica": 1000},
            "decode": {**bounds, "targetKVCacheUsage": 0.7},
        },
    }


def replicas(cluster: Any, role: str) -> int:
    return cluster.child("Deployment", f"m-{role}")["spec"]["replicas"]


def ready(cluster: Any) -> bool:
    return (cluster.model("m") or {}).get("status", {}).get("phase") == "Ready"


async def test_decode_scales_up_at_once_and_down_after_the_window(
    cluster, operator, metrics, clock
):
    metrics.kv = {"m-decode": 0.3, "m-prefill": 0.3}
    await cluster.apply(split())
    await eventually(lambda: ready(cluster), what="Ready")

    evaluations = len(metrics.queue_reads)  # one queue read per evaluation
    metrics.kv["m-decode"] = 1.0  # 1.43 replicas' worth at the 0.7 target

    reads_when_scaled: list[int] = []

    def scaled_up() -> bool:
        reads_when_scaled.append(len(metrics.queue_reads) - evaluations)
        return replicas(cluster, "decode") == 2

    await eventually(scaled_up, what="decode scaled up")
    # The evaluation under way when the load changed may have read the old gauges.
    assert reads_when_scaled[-1] <= 2, "scaled up by the first evaluation that saw the load"
    assert replicas(cluster, "prefill") == 1, "prefill is decided on its own signals"
    (event,) = await eventually(lambda: cluster.events("ScaledUp"), what="a ScaledUp Event")
    assert event["message"].startswith("decode scale 1->2")
    await eventually(lambda: _last_scale(cluster) == ("decode", 1, 2), what="lastScale 1->2")
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "decode")) == 2)

    busier, idler = sorted(p["metadata"]["name"] for p in cluster.pods("m", "decode"))
    metrics.kv.update({busier: 0.10, idler: 0.02})  # one pod's worth is plenty
    await asyncio.sleep(1.0)  # five evaluations inside the (fake) window
    assert replicas(cluster, "decode") == 2, "no scale-down inside the stabilisation window"

    clock.advance(WINDOW_S + 1)
    await eventually(lambda: replicas(cluster, "decode") == 1, what="decode scaled down")
    await eventually(
        lambda: [p["metadata"]["name"] for p in cluster.pods("m", "decode")] == [busier],
        what="the idler pod removed",
    )
    costs = {name: _last_cost(cluster, name) for name in (busier, idler)}
    assert costs[idler] < costs[busier], "the least-loaded pod was made the cheapest to remove"
    assert _first(cluster, f"pods/{idler}") < _first(cluster, "deployments/m-decode", replicas=1)
    await eventually(lambda: cluster.events("ScaledDown"), what="a ScaledDown Event")
    await eventually(lambda: _last_scale(cluster) == ("decode", 2, 1), what="lastScale 2->1")
    assert replicas(cluster, "prefill") == 1


async def test_prefill_scales_on_queued_tokens_alone(cluster, operator, metrics):
    metrics.kv = {"m-decode": 0.7}  # decode exactly at its target
    await cluster.apply(split())
    await eventually(lambda: ready(cluster), what="Ready")

    metrics.queued_tokens = 2500  # 2.5 replicas' worth at 1000 tokens per replica
    await eventually(lambda: replicas(cluster, "prefill") == 3, what="prefill scaled up")
    assert replicas(cluster, "decode") == 1
    assert ("redis://tandem-redis.tandem-system.svc:6379/0", "m") in metrics.queue_reads


async def _apply_with_redis_secret(cluster, url: str) -> None:
    """The split model, its Redis URL in the Secret model-redis."""
    secret = {
        "metadata": {"name": "model-redis"},
        "data": {"url": b64encode(url.encode()).decode()},
    }
    await cluster.api.create(SECRETS, NAMESPACE, secret)
    manifest = split()
    manifest["spec"]["redis"] = {"urlSecretRef": {"name": "model-redis"}}
    await cluster.apply(manifest)


async def test_the_queue_is_read_from_the_models_own_redis(cluster, operator, metrics):
    url = "redis://:secret@model-redis:6379/1"
    await _apply_with_redis_secret(cluster, url)
    await eventually(lambda: (url, "m") in metrics.queue_reads, what="a read of the model's Redis")
    # and declared there, so that its gateways queue requests even with no engine up
    assert (url, "m", f"{NAMESPACE}/m") in metrics.declarations


async def test_a_url_in_the_models_secret_is_read_as_the_engines_read_it(
    cluster, operator, metrics
):
    # A file's newline (kubectl create secret --from-file) is let pass, by the engines
    # (secretKeyRef, raw) and so by the operator; a leading space the engines refuse.
    url = "redis://:pw@model-redis:6379/1\n"
    await _apply_with_redis_secret(cluster, url)
    await eventually(lambda: (url, "m") in metrics.queue_reads, what="a read of the model's Redis")


async def test_a_leading_space_in_the_models_secret_is_named(cluster, operator, metrics):
    await _apply_with_redis_secret(cluster, " redis://:pw@model-redis:6379/1")
    (event,) = await eventually(lambda: cluster.events("QueueUnreadable"), what="an Event")
    assert "Secret model-redis's key 'url' is not a Redis URL" in event["message"]
    assert metrics.queue_reads == []


async def test_an_unreadable_url_in_the_models_secret_is_named_not_quoted(
    cluster, operator, metrics
):
    # A raw / in the password.
    await _apply_with_redis_secret(cluster, "redis://:Secr3tHalf/otherhalf@model-redis:6379/1")
    (event,) = await eventually(lambda: cluster.events("QueueUnreadable"), what="an Event")
    assert "Secret model-redis's key 'url' is not a Redis URL" in event["message"]
    assert "Secr3tHalf" not in str(cluster.events()) and metrics.queue_reads == []


async def test_only_the_leader_acts_and_the_standby_takes_over(cluster, metrics, clock):
    def sources() -> MetricSources:
        return MetricSources(metrics, metrics)

    leader = await cluster.start_operator(sources, clock=clock, priority=100)
    # The leader's entry first: a standby whose first look at the peering finds
    # no one else resumes, and acts until it sees the leader (one CI run saw it
    # write in that moment).
    await eventually(lambda: len(_peers(cluster)) == 1, what="the leader in the peering")
    standby = await cluster.start_operator(sources, clock=clock, priority=0)
    await eventually(lambda: len(_peers(cluster)) == 2, what="both replicas in the peering")

    await cluster.apply(split())
    await eventually(lambda: ready(cluster), what="Ready")
    await asyncio.sleep(0.6)  # three timer ticks in which a standby could have acted
    assert cluster.writes_by(leader), "the leader made the children"
    assert cluster.writes_by(standby) == [], "the standby wrote nothing"
    assert cluster.writes_by(standby, peering=True), "the standby keeps its peering entry"

    await leader.stop()  # it leaves the peering object as it goes
    await cluster.api.delete(DEPLOYMENTS, NAMESPACE, "m-decode")
    await eventually(
        lambda: cluster.child("Deployment", "m-decode"),
        timeout=5,
        what="the standby, now active, repairs the drift",
    )
    assert cluster.writes_by(standby)


async def test_a_served_namespace_without_its_peering_is_named_at_start(cluster, metrics):
    # kopf paused the operator in every namespace while one served namespace had no
    # peering object (made again after the chart's install), saying only that it resumed.
    def sources() -> MetricSources:
        return MetricSources(metrics, metrics)

    with pytest.raises(RuntimeError) as failed:
        await cluster.start_operator(sources, namespaces=(NAMESPACE, "team-b"))
    assert f"no KopfPeering '{PEERING}' in team-b: kopf pauses the operator" in str(failed.value)
    await cluster.api.create(PEERINGS, "team-b", {"metadata": {"name": PEERING}})
    assert await cluster.start_operator(sources, namespaces=(NAMESPACE, "team-b"))


async def test_a_crd_older_than_the_operator_is_named_at_start(cluster, metrics):
    # An older CRD's schema has no place for newer status fields: the API server dropped
    # them from every status written, so the status was written again at every pass and
    # a rename's guard (the names its old pods serve) was lost.
    crds = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    older = custom_resource_definition()
    status = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    del status["properties"]["retiringServedModelNames"]
    # And condition types its enum refuses: the API server refused every status written.
    kinds = status["properties"]["conditions"]["items"]["properties"]["type"]["enum"]
    kinds.remove("Stalled")
    await cluster.api.create(crds, None, older)
    with pytest.raises(RuntimeError) as failed:
        await cluster.start_operator(lambda: MetricSources(metrics, metrics))
    assert "the ModelDeployment CRD is older than this operator: its status has no " in str(
        failed.value
    )
    assert "no retiringServedModelNames, Stalled condition, which the API server" in str(
        failed.value
    )
    await cluster.api.delete(crds, None, older["metadata"]["name"])
    await cluster.api.create(crds, None, custom_resource_definition())
    assert await cluster.start_operator(lambda: MetricSources(metrics, metrics))


async def test_a_replica_that_leads_again_forgets_what_it_saw_before_it_stood_by(
    cluster, metrics, clock
):
    def sources() -> MetricSources:
        return MetricSources(metrics, metrics)

    metrics.default_kv = 0.7  # four pods at their target
    await cluster.start_operator(sources, clock=clock, priority=0)
    await eventually(lambda: len(_peers(cluster)) == 1, what="the first replica in the peering")
    window = {"scaleDownStabilizationSeconds": 300}
    await cluster.apply(normal_model(replicas=4, minReplicas=1, maxReplicas=4, **window))
    await eventually(lambda: ready(cluster) and replicas(cluster, "normal") == 4)
    await asyncio.sleep(0.6)  # it evaluates a few times
    second = await cluster.start_operator(sources, clock=clock, priority=100)
    await eventually(lambda: len(_peers(cluster)) == 2, what="both replicas in the peering")
    for _ in range(6):  # the second leads for 600 s of the autoscaler's time, 3 s of real
        clock.advance(100)
        await asyncio.sleep(0.5)
    metrics.default_kv = 0.1  # a dip, as the second replica leaves
    await second.stop()
    # The first leads again. Its last memory, a window and more old, must not let one dip
    # scale the role down: it watched nothing of the last 600 s.
    await asyncio.sleep(1.5)
    assert replicas(cluster, "normal") == 4
    assert not cluster.events("ScaledDown")


async def test_a_blip_of_the_queue_keeps_what_the_autoscaler_saw(cluster, metrics, clock):
    # A failed queue read forgot every role's history: the scale-down window began again
    # (a blip every few minutes held a role at its peak for good, and off zero).
    await cluster.start_operator(lambda: MetricSources(metrics, metrics), clock=clock)
    metrics.default_kv, metrics.running = 0.1, 1  # load for one pod of four
    window = {"scaleDownStabilizationSeconds": 300}
    await cluster.apply(normal_model(replicas=4, minReplicas=1, maxReplicas=4, **window))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 4)
    await asyncio.sleep(0.4)  # evaluations that read all four pods
    for _ in range(2):  # 200 s of the window, watched
        clock.advance(100)
        await asyncio.sleep(0.4)
    metrics.redis_down = True  # a pass or two, well within the memory's lapse
    await eventually(lambda: cluster.events("QueueUnreadable"), what="the blip seen")
    metrics.redis_down = False
    await eventually(lambda: cluster.events("QueueReadable"), what="the queue read again")
    clock.advance(150)  # 350 s since the first evaluation: the window passed
    await eventually(lambda: replicas(cluster, "normal") < 4, what="the scale-down")


async def test_a_long_queue_outage_is_one_event(cluster, metrics, clock):
    # Past the memory's lapse (2 s here) the memory was forgotten mid-outage, and the
    # next failed read posted QueueUnreadable again.
    await cluster.start_operator(lambda: MetricSources(metrics, metrics), clock=clock)
    await cluster.apply(normal_model(replicas=1, minReplicas=1, maxReplicas=4))
    await eventually(lambda: ready(cluster), what="Ready")
    await asyncio.sleep(0.5)  # evaluations that read the queue: a memory to keep
    metrics.redis_down = True
    await eventually(lambda: cluster.events("QueueUnreadable"), what="the outage seen")
    await asyncio.sleep(4.0)  # twice the lapse
    metrics.redis_down = False
    await eventually(lambda: cluster.events("QueueReadable"), what="the queue read again")
    assert len(cluster.events("QueueUnreadable")) == 1
    assert (cluster.events("QueueUnreadable")[0].get("count") or 1) == 1


async def test_api_errors_and_conflicts_are_retried(cluster, metrics, clock, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.operator.kube")
    cluster.api.fail_next("POST", DEPLOYMENTS, status=500, reason="InternalError")
    cluster.api.fail_next("PATCH", MODELS, "m", subresource="status", status=409)
    await cluster.start_operator(lambda: MetricSources(metrics, metrics), clock=clock)

    await cluster.apply(split())
    await eventually(lambda: ready(cluster), what="Ready despite the failures")
    assert cluster.api.faults_left == 0, "both failures were served"
    creates = [
        r
        for r in cluster.api
        if r.method.value == "POST"
        and r.url.path.endswith("/deployments")
        and "dryRun" not in r.params  # each write is checked first
    ]
    # The 500 met the first POST, the check of every write before any is made: the
    # pass was retried, and each Deployment then created once.
    assert len(creates) == 2, "two Deployments, each created once"
    retried = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert any("500" in m for m in retried) and any("409" in m for m in retried)


def _last_scale(cluster: Any) -> tuple[str, int, int] | None:
    scale = cluster.model("m")["status"].get("lastScale")
    return None if scale is None else (scale["role"], scale["from"], scale["to"])


def _peers(cluster: Any) -> dict[str, Any]:
    peering = cluster.api.read(PEERINGS, NAMESPACE, PEERING)
    return (peering or {}).get("status") or {}


def _last_cost(cluster: Any, pod: str) -> int:
    """The pod's deletion cost as last written (from its history: it may be gone by now)."""
    history = cluster.api.objects[PODS, NAMESPACE, pod].history
    last = next(v for v in reversed(list(history)) if v is not None)
    return int(last["metadata"]["annotations"][DELETION_COST_ANNOTATION])


def _first(cluster: Any, path: str, *, replicas: int | None = None) -> int:
    """Index in the API server's log of the first PATCH of `path` (setting `replicas`)."""
    for index, request in enumerate(cluster.api):
        data = request.data if isinstance(request.data, dict) else {}
        patched = data.get("spec", {}).get("replicas")
        matches = request.method.value == "PATCH" and request.url.path.endswith(path)
        if matches and replicas in (None, patched):
            return index
    raise AssertionError(f"no PATCH of {path}")


async def test_a_lowered_max_drains_the_least_loaded_pods_and_says_so(cluster, operator, metrics):
    bounds = {"replicas": 4, "minReplicas": 1, "maxReplicas": 6}
    await cluster.apply(normal_model(**bounds))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 4)
    pods = sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal"))
    # 2 pods' worth in all (no scale either way before the window), two nearly idle.
    metrics.kv = dict(zip(pods, (0.05, 0.65, 0.1, 0.6), strict=True))
    metrics.default_kv = 0.7

    await cluster.patch_model("m", {"spec": {"normal": {"replicas": None, "maxReplicas": 2}}})
    await eventually(lambda: replicas(cluster, "normal") == 2, what="clamped to maxReplicas")
    await eventually(
        lambda: (
            sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal")) == [pods[1], pods[3]]
        ),
        what="the two least-loaded pods removed",
    )
    (event,) = await eventually(lambda: cluster.events("ScaledDown"), what="a ScaledDown Event")
    assert event["message"] == "normal scale 4->2: above maxReplicas 2"
    await eventually(lambda: _last_scale(cluster) == ("normal", 4, 2), what="lastScale 4->2")


async def test_a_busy_pod_whose_scrape_failed_is_ranked_by_its_last_sample(
    cluster, operator, metrics
):
    # Ranked by this evaluation's samples alone, it cost 0 and went first, its requests
    # cut or recomputed elsewhere, while an idle pod stayed.
    await cluster.apply(normal_model(replicas=3, minReplicas=1, maxReplicas=6))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 3)
    pods = sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal"))
    metrics.kv = dict(zip(pods, (0.9, 0.05, 0.6), strict=True))
    reads = len(metrics.queue_reads)
    await eventually(lambda: len(metrics.queue_reads) >= reads + 2, what="evaluations")
    metrics.silent = {pods[0]}  # the busiest one's scrapes time out from now on
    reads = len(metrics.queue_reads)
    await eventually(lambda: len(metrics.queue_reads) >= reads + 2, what="evaluations")

    await cluster.patch_model("m", {"spec": {"normal": {"replicas": None, "maxReplicas": 2}}})
    await eventually(lambda: replicas(cluster, "normal") == 2, what="clamped to maxReplicas")
    await eventually(
        lambda: (
            sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal")) == [pods[0], pods[2]]
        ),
        what="the idle pod removed, the busy one kept",
    )


async def test_an_edited_spec_replicas_drains_the_least_loaded_pods_once(
    cluster, operator, metrics
):
    await cluster.apply(normal_model(replicas=4, minReplicas=1, maxReplicas=6))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 4)
    pods = sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal"))
    metrics.kv = dict(zip(pods, (0.05, 0.65, 0.1, 0.6), strict=True))
    metrics.default_kv = 0.7

    await cluster.patch_model("m", {"spec": {"normal": {"replicas": 2}}})
    await eventually(lambda: replicas(cluster, "normal") == 2, what="the edited count")
    await eventually(
        lambda: (
            sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal")) == [pods[1], pods[3]]
        ),
        what="the two least-loaded pods removed",
    )
    (event,) = await eventually(lambda: cluster.events("ScaledDown"), what="a ScaledDown Event")
    assert event["message"] == "normal scale 4->2: spec.normal.replicas set to 2"

    # Applied once: a later count (here by hand) is not set back to the spec's.
    await cluster.api.patch(DEPLOYMENTS, NAMESPACE, "m-normal", {"spec": {"replicas": 3}})
    await eventually(lambda: cluster.model("m")["status"]["roles"]["normal"]["desired"] == 3)
    await asyncio.sleep(0.5)  # a few passes, autoscaler ticks among them
    assert replicas(cluster, "normal") == 3
    assert len(cluster.events("ScaledDown")) == 1


async def test_a_count_raised_by_an_edit_is_held_for_the_scale_down_window(
    cluster, operator, metrics, clock
):
    # Weighed against the light readings from before the edit, the five pods raised
    # ahead of a burst went back to one as soon as they were ready.
    metrics.default_kv = 0.1
    await cluster.apply(
        normal_model(replicas=1, minReplicas=1, maxReplicas=6, scaleDownStabilizationSeconds=60)
    )
    await eventually(lambda: ready(cluster))
    reads = len(metrics.queue_reads)
    await eventually(lambda: len(metrics.queue_reads) >= reads + 3, what="a few evaluations")
    await cluster.patch_model("m", {"spec": {"normal": {"replicas": 5}}})
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 5)
    reads = len(metrics.queue_reads)
    await eventually(lambda: len(metrics.queue_reads) >= reads + 5, what="evaluations, ready")
    assert replicas(cluster, "normal") == 5
    clock.advance(61)  # the window passed: the light load takes it down
    await eventually(lambda: replicas(cluster, "normal") == 1, what="the scale-down")


async def test_a_hand_scale_beyond_the_bounds_is_set_back_and_reported(cluster, operator):
    await cluster.apply(normal_model(replicas=2, minReplicas=1, maxReplicas=4))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 2)

    await cluster.api.patch(DEPLOYMENTS, NAMESPACE, "m-normal", {"spec": {"replicas": 10}})
    (event,) = await eventually(lambda: cluster.events("DriftRepaired"), what="an Event")
    assert event["message"] == "Deployment m-normal: spec.replicas (10, above maxReplicas 4)"
    assert replicas(cluster, "normal") == 4

    # Within the bounds a hand scale stays, until the autoscaler decides otherwise.
    await cluster.api.patch(DEPLOYMENTS, NAMESPACE, "m-normal", {"spec": {"replicas": 3}})
    await eventually(lambda: cluster.model("m")["status"]["roles"]["normal"]["desired"] == 3)
    await asyncio.sleep(0.5)  # a few passes, autoscaler ticks among them
    assert replicas(cluster, "normal") == 3
    assert len(cluster.events("DriftRepaired")) == 1


async def test_pods_whose_metrics_nobody_reads_are_reported_once_and_held(
    cluster, operator, metrics
):
    await cluster.apply(normal_model(replicas=2, minReplicas=1, maxReplicas=4))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 2)

    metrics.unreadable = True  # as if a NetworkPolicy blocked port 8100
    (event,) = await eventually(lambda: cluster.events("MetricsUnreadable"), what="a Warning")
    assert event["type"] == "Warning"
    assert event["message"].startswith("normal: no pod's metrics readable; autoscaling holds")
    await asyncio.sleep(0.5)  # more autoscaler ticks: no second Event, no scale on a guess
    assert len(cluster.events("MetricsUnreadable")) == 1
    assert replicas(cluster, "normal") == 2

    metrics.unreadable = False
    (back,) = await eventually(lambda: cluster.events("MetricsReadable"), what="readable again")
    assert back["message"] == "normal: pods' metrics readable again"


async def test_a_scale_down_with_every_pod_ready_keeps_the_model_ready(
    cluster, operator, metrics, clock
):
    # Only a new pod template is a rollout: a count alone called one flapped Ready (and
    # its condition's lastTransitionTime) at every scale, for kubectl wait and alerts.
    metrics.default_kv = 0.7
    bounds = {"minReplicas": 1, "maxReplicas": 4, "scaleDownStabilizationSeconds": WINDOW_S}
    await cluster.apply(normal_model(replicas=3, **bounds))
    await eventually(lambda: ready(cluster) and len(cluster.pods("m", "normal")) == 3)
    since = _ready_condition(cluster)["lastTransitionTime"]
    written = _phases_written(cluster)
    metrics.default_kv = 0.1
    await asyncio.sleep(1.0)  # evaluations inside the (fake) window
    clock.advance(WINDOW_S + 1)
    await eventually(lambda: replicas(cluster, "normal") < 3, what="scaled down")
    await eventually(lambda: len(cluster.pods("m", "normal")) == replicas(cluster, "normal"))
    await asyncio.sleep(0.5)  # the passes after it
    assert written and {phase for phase, _ in written} == {"Ready"}, written
    assert _ready_condition(cluster)["lastTransitionTime"] == since


async def test_an_edit_of_a_model_at_zero_keeps_it_ready(cluster, operator):
    # A new pod template at zero pods replaces nothing: no Pending "no engine pod ready"
    # (and no moved lastTransitionTime) for an idle model someone edits.
    await cluster.apply(normal_model(replicas=0, minReplicas=0, maxReplicas=2))
    await eventually(lambda: ready(cluster))
    since = _ready_condition(cluster)["lastTransitionTime"]
    written = _phases_written(cluster)
    await cluster.patch_model("m", {"spec": {"engine": {"maxNumSeqs": 64}}})
    await eventually(lambda: cluster.model("m")["status"].get("observedGeneration") == 2)
    await asyncio.sleep(0.5)  # the passes after it
    assert written and {phase for phase, _ in written} == {"Ready"}, written
    assert _ready_condition(cluster)["lastTransitionTime"] == since
    assert replicas(cluster, "normal") == 0


def _phases_written(cluster: Any) -> list[tuple[str, str]]:
    """Every (phase, reason) the operator writes to a model's status from now on."""
    written: list[tuple[str, str]] = []

    def note(resource: Any, kind: Any, obj: dict[str, Any]) -> None:
        status = obj.get("status") or {}
        if resource == MODELS and status.get("phase"):
            written.append((status["phase"], status.get("reason", "")))

    cluster.api.listen(note)
    return written


def _ready_condition(cluster: Any) -> dict[str, Any]:
    conditions = cluster.model("m")["status"]["conditions"]
    return next(c for c in conditions if c["type"] == "Ready")
