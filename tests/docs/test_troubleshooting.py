"""docs/troubleshooting.md quotes real failure messages: each one is produced here and compared.

Every quoted message in the page sits in a fenced block right after a
`<!-- error: KEY -->` comment; PRODUCERS[KEY] makes the same failure happen
(or calls the very function that words it) and returns the text a user sees.
A reworded message in the code fails this test until the page is updated.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from support.helm import CHART, helm_path, run_helm, template_args

from tandem.engine.admission import PromptTooLongError
from tandem.engine.config import EngineConfig
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.gateway import errors
from tandem.gateway.admission import Admission
from tandem.gateway.app import create_app
from tandem.gateway.auth import ApiKey, KeyStore, check_model
from tandem.gateway.quota import QuotaDecision, refusal
from tandem.gateway.settings import GatewaySettings
from tandem.operator import crd
from tandem.operator.manifests import OperatorDefaults
from tandem.operator.manifests_pods import FETCH_SCRIPT
from tandem.operator.reconcile import plan
from tandem.operator.served_names import served_name_holder
from tandem.operator.validation import invalid_reason
from tandem.protocol import PRIORITY_NORMAL, ErrorCode

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
TANDEM = str(Path(sys.executable).with_name("tandem"))
BLOCK = re.compile(r"<!-- error: ([\w-]+) -->\n```\w*\n(.*?)\n```", re.S)


def _cli(*args: str, env: dict[str, str] | None = None) -> str:
    """The last line a failing `tandem` command prints (its error), checking it fails."""
    done = subprocess.run(
        [TANDEM, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,  # the page's relative paths (examples/...)
        env={k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | (env or {}),
        check=False,
    )
    assert done.returncode != 0, done.stdout
    return done.stderr.strip().splitlines()[-1]


def _http(path: str, authorization: str | None = None) -> str:
    """A real answer of the gateway app (its Redis is unreachable; auth comes first)."""
    settings = GatewaySettings(redis_url="redis://127.0.0.1:1/0")
    app = create_app(settings, key_store=KeyStore.load(None, "sk-a"))
    headers = {"Authorization": authorization} if authorization is not None else {}
    with TestClient(app) as client:
        response = client.get(path, headers=headers)
    return f"HTTP {response.status_code}\n{response.text}"


def _body(error: errors.GatewayError) -> str:
    """The response body as the gateway sends it (Starlette's compact JSON)."""
    return f"HTTP {error.status}\n" + json.dumps(
        error.body(), ensure_ascii=False, separators=(",", ":")
    )


def _prompt_too_long() -> str:
    config = EngineConfig(max_model_len=4096, max_num_seqs=32)
    scheduler = Scheduler(config, num_blocks=512)
    request = Request("chatcmpl-5d1f0c9a2b7e4e0f", prompt_token_ids=list(range(5000)))
    with pytest.raises(PromptTooLongError) as refused:
        scheduler.add_request(request)
    return _body(errors.from_engine(ErrorCode.PROMPT_TOO_LONG, str(refused.value), "messages"))


def _helm_error(*sets: str) -> str:
    result = run_helm(helm_path(), *template_args(CHART, sets=sets))
    assert result.returncode != 0
    return result.stderr.strip()


def _no_credentials(request: pytest.FixtureRequest) -> str:
    tmp = request.getfixturevalue("tmp_path")
    return _cli("operator", env={"KUBECONFIG": str(tmp / "none"), "HOME": str(tmp)})


def _port_in_use() -> str:
    """`tandem up` on the page's port 8000, taken (here, or by whatever holds it)."""
    with socket.socket() as taken:
        with contextlib.suppress(OSError):  # already taken: the same refusal
            taken.bind(("127.0.0.1", 8000))
            taken.listen()
        return _cli("up", "--port", "8000")


def _fetch_without_hub() -> str:
    (message,) = re.findall(r'sys\.exit\("([^"]+)"\)', FETCH_SCRIPT)
    return message


def _served_name_taken() -> str:
    """The status message of a new model whose served name an older one serves."""
    model = {
        "metadata": {"name": "llama-8b-copy", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {"model": {"path": "/m", "servedModelName": "llama-3.1-8b-instruct"}, "normal": {}},
    }
    defaults = OperatorDefaults(image="engine", redis_url="redis://r:6379/0")
    older = copy.deepcopy(model)
    older["metadata"].update(name="llama-8b", creationTimestamp="2025-01-01T00:00:00Z")
    older["status"] = {"servedModelName": "llama-3.1-8b-instruct"}
    model["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    holder = served_name_holder(model, [older, model], defaults.redis_url)
    actions = plan(model, [], defaults, now="2026-01-01T00:00:00Z", holder=holder)
    assert actions.status is not None
    return actions.status["message"]


def _cel_message(fragment: str) -> str:
    messages = re.findall(r"'message': '([^']+)'", str(crd.root_schema()))
    (found,) = [m for m in set(messages) if fragment in m]
    return found


PRODUCERS: dict[str, Callable[[Path], str]] = {
    "cel-replica-bounds": lambda _: _cel_message("minReplicas must not exceed"),
    "invalid-replica-bounds": lambda _: invalid_reason(
        {"model": {"path": "smollm2"}, "normal": {"minReplicas": 3, "maxReplicas": 2}},
        name="smollm2",
    ),
    "invalid-kv-cache-memory": lambda _: invalid_reason(
        {"model": {"path": "smollm2"}, "engine": {"kvCacheMemory": "1.5"}, "normal": {}},
        name="smollm2",
    ),
    "too-little-kv-cache": lambda _: invalid_reason(
        {"model": {"path": "smollm2"}, "engine": {"kvCacheMemory": "512Ki"}, "normal": {}},
        name="smollm2",
    ),
    "invalid-budget": lambda _: invalid_reason(
        {
            "model": {"path": "smollm2"},
            "engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 4096},
            "normal": {},
        },
        name="smollm2",
    ),
    "served-name-taken": lambda _: _served_name_taken(),
    # In a pod Redis answers (the engine checks it first), so here a real one does too.
    "engine-missing-model": lambda request: _cli(
        "engine",
        *("--model", "/models/llama-3.1-8b", "--served-model-name", "llama-8b"),
        *("--redis-url", request.getfixturevalue("redis_url")),
    ),
    "fetch-no-hub": lambda _: _fetch_without_hub(),
    "up-port-in-use": lambda _: _port_in_use(),
    "up-cluster-manifest": lambda _: _cli("up", "-f", "examples/smollm2-cpu.yaml"),
    "gateway-no-keys": lambda _: _cli("gateway", "--redis-url", "redis://127.0.0.1:1/0"),
    "engine-redis-unreachable": lambda _: _cli(
        "engine",
        "--model",
        "random:tiny",
        "--redis-wait",
        "1",
        "--redis-url",
        "redis://:secret@127.0.0.1:1/0",
    ),
    "operator-no-credentials": _no_credentials,
    "401-missing": lambda _: _http("/v1/models"),
    "401-invalid": lambda _: _http("/v1/models", "Bearer sk-b"),
    "403": lambda _: _body(
        _refused(
            lambda: check_model(
                ApiKey("team-a", models=frozenset({"llama-8b"})), "smollm2-135m-instruct"
            )
        )
    ),
    "404": lambda _: _body(errors.model_not_found("smollm2-135m-instruct", ["smollm2"])),
    "400-prompt-too-long": lambda _: _prompt_too_long(),
    "429-queue-full": lambda _: _queue_full(),
    "429-rpm": lambda _: _body(
        refusal(ApiKey("team-a", rpm=600), 40, QuotaDecision(False, "rpm", 0.1))
    ),
    "504": lambda _: _deadline(600),
    "503-readyz": lambda _: _http("/readyz"),
    "helm-schema": lambda _: _helm_error("gateway.replicas=-1"),
    "helm-no-key-source": lambda _: _helm_error("gateway.auth.bootstrapKey=false"),
}


def _refused(call: Callable[[], object]) -> errors.GatewayError:
    with pytest.raises(errors.GatewayError) as refused:
        call()
    return refused.value


class _FullQueue:
    """The queue gauge of a model with 1000 requests waiting."""

    async def reserve(self, model: str, count: int, limit: int) -> int | None:
        return 1000


class _Job:
    model = "smollm2-135m-instruct"
    n = 1
    items = (SimpleNamespace(priority=PRIORITY_NORMAL),)


def _queue_full() -> str:
    admission = Admission.__new__(Admission)  # only the queue check: no Redis behind it
    admission.settings = GatewaySettings()
    admission.queues = _FullQueue()  # type: ignore[assignment]
    return _body(_refused(lambda: asyncio.run(admission._reserve_room(_Job()))))  # type: ignore[arg-type]


def _deadline(seconds: int) -> str:
    """The 504 of a request whose deadline passed, worded as gateway/generation.py words it."""
    source = (ROOT / "gateway" / "generation.py").read_text()
    (template,) = re.findall(r'deadline_exceeded\(\s*f"([^"]+)"', source)
    message = template.replace("{self.job.timeout:g}", f"{seconds:g}")
    assert "{" not in message, f"generation.py words it differently now: {template}"
    return _body(errors.deadline_exceeded(message))


def _quoted() -> dict[str, str]:
    return dict(BLOCK.findall(PAGE.read_text()))


def test_every_quoted_message_has_a_producer():
    assert set(_quoted()) == set(PRODUCERS)


@pytest.mark.parametrize("key", sorted(PRODUCERS))
def test_the_page_quotes_what_the_code_says(key, request):
    # A producer asks `request` for the fixtures it needs (a folder, a Redis).
    assert _quoted()[key] == PRODUCERS[key](request)
