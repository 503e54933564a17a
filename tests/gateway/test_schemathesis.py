"""schemathesis over the gateway's own OpenAPI schema, against the live server.

Every operation, positive and negative data, a bounded number of examples:
no 5xx, every status documented, every body (errors included) as documented.
Model names are narrowed to the served one and an unknown one, and lengths to
a few tokens, so generated requests reach the engine and finish quickly.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tandem.gateway.auth import KeyStore

from .live import API_KEY, LiveGateway, settings_for

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 20}


# Declared for compatibility but refused unless neutral, or (logit_bias) valid only
# with the model's own token ids as keys: generating them mostly produces 400s,
# which the error-table tests cover.
REFUSED = (
    "logit_bias",
    "tools", "tool_choice", "response_format", "best_of", "echo", "suffix", "stream_options",
)  # fmt: skip
SMALL = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 6}, {"type": "null"}]}


def _narrowed(schema: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)
    components = schema["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = components[name]["properties"]
        properties["model"] = {"type": "string", "enum": ["tiny", "no-such-model"]}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                properties[field] = SMALL
        properties["n"] = {**SMALL, "anyOf": [{"type": "integer", "minimum": 1, "maximum": 2}]}
        for field in REFUSED:
            properties.pop(field, None)
    components["CompletionRequest"]["properties"]["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                       "maximum": 511}},
        ]
    }  # fmt: skip
    components["ContentPart"] = {
        "type": "object",
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    components["ChatMessage"]["properties"]["content"]["anyOf"].pop()  # not null
    # Each belongs to one role (some are served only empty): elsewhere, a 400.
    for field in ("refusal", "audio", "tool_calls", "function_call", "annotations", "tool_call_id"):
        components["ChatMessage"]["properties"].pop(field)
    components["ChatMessage"]["required"] = ["role", "content"]
    return schema


@pytest.fixture(scope="module")
def gateway(redis_server, shared_keys, shared_engine):
    # Requests without max_tokens generate 4 tokens, not the 1024 default.
    settings = settings_for(redis_server.url, shared_keys, default_max_tokens=4)
    live = LiveGateway(settings, KeyStore.load(None, API_KEY)).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def api(gateway):
    return schemathesis.openapi.from_dict(_narrowed(gateway.app.openapi()))


def _operations(api):
    return [result.ok() for result in api.get_all_operations()]


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_every_operation_answers_as_documented(gateway, api, mode):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    operations = _operations(api)
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    if mode is GenerationMode.NEGATIVE:  # only what has inputs can get invalid ones
        operations = [op for op in operations if op.body or op.path_parameters]
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES[mode],
            deadline=None,
            database=None,
            derandomize=True,  # the same cases every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            case.call_and_validate(base_url=gateway.url, headers=headers, checks=checks, timeout=30)

        check()
