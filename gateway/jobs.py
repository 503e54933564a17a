"""A Job: what one OpenAI request becomes in Redis (its work items), and how.

Building a Job is where a request is checked beyond its JSON types: refused
parameters, conflicting ones, the sampling parameters (sampling.py), priority and
timeout headers. The engine tokenizes; the gateway only estimates the prompt's
tokens (prompts.py) for the queued-tokens counter and the tpm quota.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic_core import PydanticSerializationError
from starlette.datastructures import Headers

from tandem.gateway.auth import ApiKey
from tandem.gateway.errors import bad_request, forbidden, not_supported
from tandem.gateway.messages import chat_options, engine_message, tools_for_template
from tandem.gateway.prompts import completion_prompts, estimated_tokens, tokens_of_size, utf8_size
from tandem.gateway.sampling import sampling_fields, with_seed
from tandem.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tandem.gateway.settings import GatewaySettings
from tandem.protocol import PRIORITY_HIGH, PRIORITY_LOW, PRIORITY_NORMAL, WorkItem

PRIORITY_HEADER = "x-tandem-priority"
TIMEOUT_HEADER = "x-tandem-timeout"
IDEMPOTENCY_HEADER = "idempotency-key"
_PRIORITIES = {"high": PRIORITY_HIGH, "normal": PRIORITY_NORMAL, "low": PRIORITY_LOW}
# OpenAI's default max_tokens for (legacy) completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# What a chat template adds around each message (ChatML's <|im_start|>role\n ...
# <|im_end|>\n, Llama 3's headers: 5 to 7 tokens), so that many short messages cost what
# they run: 200 empty ones were estimated at 1 token and prefilled ~1,400, a client that
# left after the first token keeping the estimate's charge.
_TOKENS_PER_MESSAGE = 8
# Chat parameters Tandem does not implement, in the schema's order (the first bad
# one is named): the values besides null that ask for nothing (OpenAI's defaults,
# which clients send), and what any other value is refused as.
_UNSERVED_PARAMS: dict[str, tuple[tuple[object, ...], str | None]] = {
    "audio": ((), None),
    "function_call": (("none",), "function_call other than none"),
    "functions": (([],), None),
    "modalities": ((["text"],), "modalities other than ['text']"),
    "moderation": ((), None),
    "prediction": ((), None),
    "reasoning_effort": (("none",), "reasoning_effort other than none"),
    "response_format": (({"type": "text"},), "response_format other than text"),
    "service_tier": (("auto", "default"), "service_tier other than auto or default"),
    "tool_choice": (("none",), None),
    "tools": (([],), 'tools (tool calls; with tool_choice "none" they reach the template only)'),
    "verbosity": (("medium",), "verbosity other than medium"),
    "web_search_options": ((), None),
}


@dataclass(frozen=True)
class Job:
    kind: Literal["chat", "completion"]
    model: str
    # The response id is derived from it; work item ids too.
    base_id: str
    created: int
    items: tuple[WorkItem, ...]
    stream: bool
    include_usage: bool
    # Seconds the whole request may take (the work items carry the absolute deadline).
    timeout: float
    max_tokens: int
    body: ChatCompletionRequest | CompletionRequest = field(repr=False, compare=False)
    # What else each work item carries, its stop strings, in the estimate's tokens: it
    # holds Redis and an engine as a prompt does (4 stop strings of 255 kB, n=16, held
    # 16 MB of Redis for 46 tokens of a key's tpm).
    carried_tokens: int = 0
    # How many prompts the items hold (a completions batch): prompt-major, each prompt's
    # choices in a row, so prompt p's choice i is item p * choices_per_prompt + i.
    prompts: int = 1

    @property
    def n(self) -> int:
        """The work items: every choice of every prompt."""
        return len(self.items)

    @property
    def choices_per_prompt(self) -> int:
        return len(self.items) // self.prompts

    @property
    def prompt_items(self) -> tuple[WorkItem, ...]:
        """Each prompt's first work item (its choices differ only in their seeds)."""
        return self.items[:: self.choices_per_prompt]

    @property
    def logprobs(self) -> bool:
        """Whether the answer carries logprobs (the engines report them per token)."""
        return "logprobs" in self.items[0].sampling

    @property
    def chat_option(self) -> str | None:
        """The first template option the request sets other than the default, or None
        (engines from before the options would render without them)."""
        first = self.items[0]
        if not first.add_generation_prompt:
            return "add_generation_prompt"
        if first.chat_template_kwargs:
            return "chat_template_kwargs"
        return None

    @property
    def request_ids(self) -> list[str]:
        return [item.request_id for item in self.items]

    @property
    def max_tokens_given(self) -> bool:
        """Whether the client set max_tokens (else a default counts)."""
        return self.items[0].max_tokens_given

    def counted_max_tokens(self, max_model_len: int | None = None) -> int:
        """The max_tokens a quota counts (of a batch's prompts, the most): the client's,
        else the default cut to the room the prompt leaves in a context of
        `max_model_len` (as the engine cuts it): a key whose tpm was below the default
        was refused every such request on a small model."""
        return max(self._counted(item, max_model_len) for item in self.prompt_items)

    def _counted(self, item: WorkItem, max_model_len: int | None) -> int:
        if max_model_len is None or self.max_tokens_given:
            return self.max_tokens
        return max(1, min(self.max_tokens, max_model_len - item.estimated_prompt_tokens))

    def cost_tokens(self, max_model_len: int | None = None) -> int:
        """What the tpm quota charges: estimated prompt, stop strings and max_tokens, per
        choice."""
        return sum(
            item.estimated_prompt_tokens + self.carried_tokens + self._counted(item, max_model_len)
            for item in self.items
        )

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def max_tokens_param(self) -> str:
        """The field the client gave max_tokens in."""
        chat = isinstance(self.body, ChatCompletionRequest)
        return "max_completion_tokens" if chat and self.body.max_completion_tokens else "max_tokens"

    @cached_property
    def digest(self) -> str:
        """The request's content, for Idempotency-Key (computed only when one is sent).

        Delivery (stream or not) is not part of what was asked: a client may
        retry a stream without streaming and get the same answer. Only the fields
        the client sent count (and a null one as not sent): a field a later version
        adds, whatever its default, does not change the digest of a request that
        does not send it. Canonical JSON (keys sorted, ASCII): an object's keys in
        another order (logit_bias, chat_template_kwargs, re-serialised by a proxy or
        a retry layer) are the same request. (The gateways before either rule digested
        otherwise: across an upgrade from one, a retry through a replica of the other
        version is a 409 until the first attempt's record expires.)
        """
        sent: dict[str, Any] = {
            "exclude": {"stream", "stream_options"},
            "exclude_unset": True,
            "exclude_none": True,
        }
        try:
            data = self.body.model_dump(mode="json", **sent)
        except (PydanticSerializationError, ValueError):
            # Nested past pydantic's serialisation depth (255) in a field the engine
            # never reads: nothing to compare a retry by.
            raise bad_request(
                "the request is nested too deeply (past 255 levels) to be compared "
                "with a retry: send it without Idempotency-Key, or less deeply nested"
            ) from None
        # ASCII: a lone surrogate (JSON's \ud800, a JavaScript client's cut emoji) in a
        # field the engine never reads is escaped, not refused as UTF-8.
        content = json.dumps(data, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(content.encode()).hexdigest()


# The headers a job reads, as the errors name them.
_JOB_HEADERS = {
    PRIORITY_HEADER: "X-Tandem-Priority",
    TIMEOUT_HEADER: "X-Tandem-Timeout",
    IDEMPOTENCY_HEADER: "Idempotency-Key",
}


def job_headers(headers: Headers) -> dict[str, str]:
    """The headers a job reads, each sent at most once: read by its first, a second
    one went unchecked (a bad priority passed behind a good one) and unheeded."""
    found = {}
    for name, shown in _JOB_HEADERS.items():
        values = headers.getlist(name)
        if len(values) > 1:
            raise bad_request(f"{shown} was sent {len(values)} times: send it once", shown)
        if values:
            found[name] = values[0]
    return found


class JobBuilder:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    def chat(self, body: ChatCompletionRequest, headers: Mapping[str, str], caller: ApiKey) -> Job:
        _refuse_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        for name, (neutral, what) in _UNSERVED_PARAMS.items():
            value = getattr(body, name)
            if isinstance(value, dict) and value.get("type") == "text" and len(value) > 1:
                # A text format with a field OpenAI's has not: named as an unknown field,
                # not as a format other than text.
                extra = f"{name}.{next(k for k in value if k != 'type')}"
                raise bad_request(f"Unrecognized request argument supplied: {extra}", extra)
            if name == "tools" and tools_for_template(body):
                continue
            if value not in (None, *neutral):
                raise not_supported(name, what)
        if (
            body.max_tokens is not None
            and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens
        ):
            raise bad_request(
                "max_tokens and max_completion_tokens differ: give one of them",
                "max_completion_tokens",
            )
        max_tokens = body.max_completion_tokens or body.max_tokens
        messages = [engine_message(i, m) for i, m in enumerate(body.messages)]
        size = sum(utf8_size(m["content"]) + utf8_size(m.get("name", "")) for m in messages)
        estimate = tokens_of_size(size) + _TOKENS_PER_MESSAGE * len(messages)
        options = chat_options(body)
        if kwargs := options.get("chat_template_kwargs"):
            # Variables the template writes into the prompt (tools, documents): left out,
            # 67 KB of them were charged 10 tokens of a key's tpm, for ~25,000 prefilled.
            estimate += tokens_of_size(utf8_size(json.dumps(kwargs, ensure_ascii=False)))
        prompt = {"messages": messages, **options}
        return self._job("chat", body, headers, caller, [(prompt, estimate)], max_tokens)

    def completion(
        self, body: CompletionRequest, headers: Mapping[str, str], caller: ApiKey
    ) -> Job:
        _refuse_common(body)
        if body.echo:
            raise not_supported("echo")
        if body.suffix:
            raise not_supported("suffix")
        n = body.n or 1
        if body.best_of is not None and body.best_of < n:  # OpenAI's rule
            raise bad_request(f"best_of ({body.best_of}) must be at least n ({n})", "best_of")
        if body.best_of not in (None, n):
            raise not_supported("best_of", "best_of other than n")
        prompts = completion_prompts(body.prompt)
        if len(prompts) * n > self.settings.max_work_items:
            raise bad_request(
                f"a request may queue {self.settings.max_work_items} work items at most (one "
                f"a choice of each prompt), and {len(prompts)} prompts x n={n} make "
                f"{len(prompts) * n}: send the prompts in several requests",
                "prompt",
            )
        return self._job(
            "completion",
            body,
            headers,
            caller,
            [(prompt, estimated_tokens(prompt)) for prompt in prompts],
            body.max_tokens,
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        )

    def _job(
        self,
        kind: Literal["chat", "completion"],
        body: ChatCompletionRequest | CompletionRequest,
        headers: Mapping[str, str],
        caller: ApiKey,
        prompts: list[tuple[dict[str, Any], int]],
        max_tokens: int | None,
        default_max_tokens: int | None = None,
    ) -> Job:
        n = body.n or 1
        if n > self.settings.max_n:
            raise bad_request(f"n must be at most {self.settings.max_n}, got {n}", "n")
        given = max_tokens is not None  # the client's: it must fit in the context
        max_tokens = max_tokens or default_max_tokens or self.settings.default_max_tokens
        sampling = sampling_fields(body, max_tokens)
        priority = _priority(body.priority, headers.get(PRIORITY_HEADER))
        if caller.max_priority is not None:
            most = _PRIORITIES[caller.max_priority]
            if body.priority is None and headers.get(PRIORITY_HEADER) is None:
                priority = min(priority, most)  # unasked: normal, or the key's limit below it
            elif priority > most:
                raise forbidden(
                    f"API key {caller.name!r} may ask for priority {caller.max_priority} at most",
                    "priority_not_allowed",
                    "priority",
                )
        timeout = _timeout(self.settings.request_timeout, headers.get(TIMEOUT_HEADER))
        salt = cache_salt(caller, body.cache_salt)
        base_id = uuid.uuid4().hex
        now = time.time()
        single = len(prompts) * n == 1
        # Each prompt's choice i seeded as choice i of that prompt alone: a batch answers
        # what its prompts sent one by one answer.
        items = tuple(
            WorkItem(
                request_id=base_id if single else f"{base_id}-{p * n + i}",
                model=body.model,
                sampling=with_seed(sampling, i),
                priority=priority,
                created_at=now,
                deadline=now + timeout,
                estimated_prompt_tokens=estimate,
                max_tokens_given=given,
                cache_salt=salt,
                **prompt,
            )
            for p, (prompt, estimate) in enumerate(prompts)
            for i in range(n)
        )
        return Job(
            kind=kind,
            model=body.model,
            base_id=base_id,
            created=int(now),
            items=items,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            timeout=timeout,
            max_tokens=max_tokens,
            body=body,
            carried_tokens=_carried(sampling),
            prompts=len(prompts),
        )


def _refuse_common(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _carried(sampling: dict[str, Any]) -> int:
    """The estimate's tokens of a work item's stop strings (none: 0)."""
    size = sum(utf8_size(stop) for stop in sampling.get("stop", ()))
    return tokens_of_size(size) if size else 0


def cache_salt(caller: ApiKey, salt: str | None) -> str | None:
    """The engines' prefix-cache salt: the caller's own (a key with prefix_cache: own),
    then the request's cache_salt. Each part is tagged, so a request's salt cannot
    spell another key's."""
    parts = [f"key={caller.name}"] if caller.own_prefix_cache else []
    parts += [f"salt={salt}"] if salt is not None else []
    return "\n".join(parts) or None


def _priority(field: str | None, header: str | None) -> int:
    from_header = None if header is None else _PRIORITIES.get(header.strip().lower())
    if header is not None and from_header is None:  # a typo even where the field wins
        raise bad_request(
            f"X-Tandem-Priority must be high, normal or low, got {header!r}", "X-Tandem-Priority"
        )
    # The body's field wins over the header: it is the more specific of the two.
    if field is not None:
        return _PRIORITIES[field]
    return PRIORITY_NORMAL if from_header is None else from_header


def _timeout(limit: float, header: str | None) -> float:
    if header is None:
        return limit
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise bad_request(
            f"X-Tandem-Timeout must be a positive number of seconds, got {header!r}",
            "X-Tandem-Timeout",
        )
    # Only ever smaller: the server's limit protects the engines.
    return min(limit, seconds)
