"""The operator's API client (retries, errors, requests) and its settings, without a server."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from tandem.operator.kube import Backoff, KubeApi
from tandem.operator.kube_connection import Connection
from tandem.operator.settings import OperatorSettings, add_arguments, from_args

QUICK = Backoff(attempts=4, base_s=0.0, cap_s=0.0)


def status(code: int, reason: str) -> httpx.Response:
    body = {"kind": "Status", "code": code, "reason": reason, "message": f"it is {reason}"}
    return httpx.Response(code, json=body)


def api(responses: list[httpx.Response], seen: list[httpx.Request], **connection) -> KubeApi:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return responses.pop(0)

    return KubeApi(
        Connection(server="http://api", **connection),
        backoff=QUICK,
        transport=httpx.MockTransport(answer),
    )


@pytest.mark.asyncio
async def test_conflicts_and_server_errors_are_retried_until_they_pass():
    seen: list[httpx.Request] = []
    kube = api(
        [
            status(409, "Conflict"),
            status(503, "ServiceUnavailable"),
            httpx.Response(200, json={"metadata": {"name": "d"}}),
        ],
        seen,
    )
    assert await kube.patch("Deployment", "ns", "d", {"spec": {"replicas": 2}}) is not None
    assert len(seen) == 3
    assert seen[0].headers["Content-Type"] == "application/merge-patch+json"
    assert seen[0].url.path == "/apis/apps/v1/namespaces/ns/deployments/d"
    assert json.loads(seen[0].content) == {"spec": {"replicas": 2}}


@pytest.mark.asyncio
async def test_retries_end_with_the_last_error():
    seen: list[httpx.Request] = []
    kube = api([status(500, "InternalError")] * 4, seen)
    with pytest.raises(Exception, match="500 InternalError") as failure:
        await kube.get("Pod", "ns", "p")
    assert failure.value.status == 500 and len(seen) == 4


@pytest.mark.asyncio
async def test_already_exists_and_bad_requests_are_not_retried():
    seen: list[httpx.Request] = []
    kube = api([status(409, "AlreadyExists"), status(422, "Invalid")], seen)
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}}
    with pytest.raises(Exception, match="AlreadyExists") as exists:
        await kube.create(obj)
    assert exists.value.already_exists
    with pytest.raises(Exception, match="422"):
        await kube.create(obj)
    assert len(seen) == 2


@pytest.mark.asyncio
async def test_a_missing_object_is_none_and_deleting_it_is_fine():
    seen: list[httpx.Request] = []
    kube = api([status(404, "NotFound")] * 3, seen)
    assert await kube.get("ModelDeployment", "ns", "m") is None
    assert await kube.patch_status("ModelDeployment", "ns", "m", {"phase": "Ready"}) is None
    await kube.delete("Service", "ns", "s")
    assert seen[0].url.path == "/apis/serving.tandem.dev/v1alpha1/namespaces/ns/modeldeployments/m"
    assert seen[1].url.path.endswith("/modeldeployments/m/status")


@pytest.mark.asyncio
async def test_a_401_reloads_the_credentials_once():
    seen: list[httpx.Request] = []
    tokens = iter(["Bearer old", "Bearer new"])
    current = {"value": next(tokens)}
    reloads = []

    def reload() -> Connection:
        reloads.append(1)
        current["value"] = next(tokens)
        return Connection(server="http://api", authorization=lambda: current["value"])

    kube = api(
        [status(401, "Unauthorized"), httpx.Response(200, json={})],
        seen,
        authorization=lambda: current["value"],
        reload=reload,
    )
    await kube.get("Pod", "ns", "p")
    assert [r.headers["Authorization"] for r in seen] == ["Bearer old", "Bearer new"]
    assert reloads == [1]


@pytest.mark.asyncio
async def test_lists_follow_continue_tokens_and_use_a_label_selector():
    seen: list[httpx.Request] = []
    pages = [
        httpx.Response(200, json={"metadata": {"continue": "t"}, "items": [{"metadata": {}}]}),
        httpx.Response(200, json={"metadata": {}, "items": [{"metadata": {}}]}),
    ]
    items = await api(pages, seen).list("Deployment", "ns", {"b": "2", "a": "1"})
    assert [i["kind"] for i in items] == ["Deployment", "Deployment"]
    assert seen[0].url.params["labelSelector"] == "a=1,b=2"
    assert seen[1].url.params["continue"] == "t"


@pytest.mark.asyncio
async def test_a_lost_event_is_not_an_error():
    seen: list[httpx.Request] = []
    involved = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}}
    await api([status(403, "Forbidden")], seen).post_event(involved, reason="X", message="y")
    event = json.loads(seen[0].content)
    assert event["involvedObject"]["name"] == "p" and event["type"] == "Normal"


def test_backoff_grows_and_is_capped():
    delays = list(Backoff(attempts=8, base_s=0.1, cap_s=1.0).delays())
    assert len(delays) == 7
    assert all(0 <= d <= min(1.0, 0.1 * 2**i) for i, d in enumerate(delays))


# ------------------------------------------------------------------ settings


def parse(*argv: str, env: dict[str, str] | None = None) -> OperatorSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(argv), env or {})


def test_flags_beat_the_environment_which_beats_the_defaults():
    env = {"TANDEM_OPERATOR_NAMESPACES": "a, b", "TANDEM_OPERATOR_SCRAPE_INTERVAL": "5"}
    settings = parse("--priority", "100", env=env)
    assert settings.namespaces == ("a", "b") and settings.scrape_interval_s == 5.0
    assert settings.priority == 100 and not settings.clusterwide
    assert parse("--namespace", "c", env=env).namespaces == ("c",)
    assert parse().clusterwide and parse().engine_image.startswith("ghcr.io/")


def test_engine_pull_secrets_repeat_as_flags_and_split_at_commas_in_the_variable():
    variable = "TANDEM_OPERATOR_ENGINE_IMAGE_PULL_SECRETS"
    assert parse().engine_image_pull_secrets == ()
    assert parse(env={variable: " regcred, mirror.example.com,,"}).engine_image_pull_secrets == (
        "regcred",
        "mirror.example.com",
    )
    flags = parse(
        "--engine-image-pull-secret", "a", "--engine-image-pull-secret", "b", env={variable: "c"}
    )
    assert flags.engine_image_pull_secrets == ("a", "b")  # the flags, not the variable


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--engine-image-pull-secret", "Reg_Cred"], {}, "'Reg_Cred' is not a Secret name: a "),
        ([], {"TANDEM_OPERATOR_ENGINE_IMAGE_PULL_SECRETS": "ok,-bad"}, "'-bad' is not a Secret"),
        (["--engine-image-pull-secret", "a,b"], {}, "'a,b' is not a Secret name"),
        (["--engine-image-pull-secret", ""], {}, "'' is not a Secret name"),
        (["--engine-image-pull-secret", "x" * 254], {}, "at most 253"),
        (["--engine-image-pull-secret", "r"] * 2, {}, "'r' is given twice"),
    ],
)
def test_bad_engine_pull_secrets_are_refused(argv, env, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv, env=env)


def test_engine_run_as_user_takes_an_id_or_none():
    variable = "TANDEM_OPERATOR_ENGINE_RUN_AS_USER"
    assert parse().engine_run_as_user == 10001
    # An empty variable is unset, as for every setting: the default.
    assert parse(env={variable: ""}).engine_run_as_user == 10001
    assert parse(env={variable: "1000650000"}).engine_run_as_user == 1000650000
    for spelling in ("none", "None", " NONE "):
        assert parse(env={variable: spelling}).engine_run_as_user is None
    # The flag's "none" is a value, not "no flag": it beats the variable.
    assert parse("--engine-run-as-user", "none", env={variable: "5"}).engine_run_as_user is None
    assert parse("--engine-run-as-user", "7", env={variable: "none"}).engine_run_as_user == 7


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            [],
            {"TANDEM_OPERATOR_ENGINE_RUN_AS_USER": "0"},
            "TANDEM_OPERATOR_ENGINE_RUN_AS_USER: .*root",
        ),
        (["--engine-run-as-user", "-1"], {}, "--engine-run-as-user: .*at least 1"),
        (["--engine-run-as-user", "nobody"], {}, "a user id .* or 'none', got 'nobody'"),
        ([], {"TANDEM_OPERATOR_ENGINE_RUN_AS_USER": "null"}, "or 'none', got 'null'"),
    ],
)
def test_bad_engine_run_as_users_are_refused(argv, env, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv, env=env)
    with pytest.raises(ValueError, match="at least 1"):
        OperatorSettings(engine_run_as_user=0)


def test_bad_settings_name_the_variable():
    with pytest.raises(ValueError, match="TANDEM_OPERATOR_SCRAPE_INTERVAL"):
        parse(env={"TANDEM_OPERATOR_SCRAPE_INTERVAL": "soon"})
    with pytest.raises(ValueError, match="not a namespace"):
        parse("--namespace", "Bad_Name")
    with pytest.raises(ValueError, match="redis"):
        parse("--redis-url", "http://x")
