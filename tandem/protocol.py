"""The contract between gateway and engines: message formats (key names: tandem/keys.py).

Both sides import this module (and tandem.deduplicator, the rule for reading a
response stream) and nothing of each other, with one exception: the gateway
checks sampling parameters with the engine's own SamplingParams
(tandem.engine.request, pure Python, no torch), so both agree on what is valid
(tests/gateway/test_app_and_cli.py holds the gateway to that). Everything crossing
Redis is a versioned JSON document in one stream field ("data"), so a field
can be added without breaking readers, and a reader refuses a major version it
does not know instead of misreading it.

Request path (docs/protocol.md has the whole story):

    gateway  --XADD WorkItem-->      work stream {model} per priority   (group "engines")
    PROMPT   --XADD Handoff-->       handoff stream {model} per priority (group "decoders")
    engines  --XADD ResponseEvent--> response stream per request        (gateway XREADs)
    gateway  --SET + PUBLISH-->      cancel key and channel
    engines  --SET (TTL)-->          registry entry per engine          (heartbeat;
                                     tandem/registry_entry.py)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1

# Priority levels, highest first: engines take work from higher levels first.
PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW = 2, 1, 0
PRIORITIES = (PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW)

# Consumer groups.
WORK_GROUP = "engines"
HANDOFF_GROUP = "decoders"


class ProtocolError(ValueError):
    """A message that cannot be read: bad JSON, wrong version, missing fields."""


class Role(StrEnum):
    """What kind of steps an engine runs (the engine's config calls it EngineType)."""

    NORMAL = "normal"  # prefill and decode, chosen per step by the ALL/ANY votes
    PROMPT = "prompt"  # prefill only; KV is pinned and handed to a COMPLETION engine
    COMPLETION = "completion"  # decode only (prefill only to recompute lost KV)


class ErrorCode(StrEnum):
    """Why a request failed, as the engine reports it; the gateway maps it to HTTP."""

    PROMPT_TOO_LONG = "prompt_too_long"  # 400, message names both lengths
    # 400: prompt + the client's max_tokens exceed the context (OpenAI's code).
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_REQUEST = "invalid_request"  # 400: bad sampling parameters, bad token ids
    DEADLINE_EXCEEDED = "deadline_exceeded"  # 504
    CANCELLED = "cancelled"  # the client went away
    REDELIVERY_LIMIT = "redelivery_limit"  # 503: engines kept dying while serving it
    ENGINE_ERROR = "engine_error"  # 500: a bug; the message says what


def check_served_name(name: str) -> str:
    """`name`, or a ValueError saying what a served model name may not be. Its keys
    share the Redis Cluster hash tag {name}: an empty tag, or a brace inside it, would
    scatter one model's streams over slots (CROSSSLOT). (The operator's CRD is
    stricter: no whitespace, 253 characters at most, as Kubernetes names go.)"""
    if not isinstance(name, str) or not name or "{" in name or "}" in name:
        raise ValueError(
            "a served model name must be non-empty and hold no braces (it keys the "
            f"model's Redis streams), got {name!r}"
        )
    return name


def check_key_prefix(prefix: str, name: str) -> str:
    """`prefix`, or a ValueError (naming the setting `name`) for one that cannot begin
    every key: empty, or holding a brace (the hash tags) or whitespace."""
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \t\n"):
        raise ValueError(f"{name} must be non-empty without braces or spaces, got {prefix!r}")
    return prefix


# How long a response stream lives after its last event: long enough for a
# slow client and for an engine that re-delivers the request to see it ended.
RESPONSE_TTL_SECONDS = 600
# ...and once a gateway delivered all of it to a client that sent no
# Idempotency-Key (no retry will attach to it): past an engine's takeover of a
# request whose final event was written but not acknowledged (claim_idle, 30 s).
DELIVERED_RESPONSE_TTL_SECONDS = 60
# A cancellation is remembered this long (a request queued longer is rare).
CANCEL_TTL_SECONDS = 3600
# A request id stays marked queued this long: far longer than a producer's
# reconnect-and-retry of its enqueue (about a second), which must find it queued.
ENQUEUED_TTL_SECONDS = 60


class Message:
    """JSON round trip with a version check, for the dataclasses below."""

    KIND: ClassVar[str]

    def to_fields(self) -> dict[str, str]:
        # Fields at their defaults are left out (readers fill them in): a token's
        # event is ~100 bytes, not ~230, in the streams Redis keeps for minutes.
        defaults = _defaults(type(self))
        body = {
            k: v
            for k, v in dataclasses.asdict(self).items()  # type: ignore[call-overload]
            if k not in defaults or v != defaults[k]
        }
        data = json.dumps(body, separators=(",", ":"))
        return {"v": str(PROTOCOL_VERSION), "kind": self.KIND, "data": data}

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]):
        fields = {as_text(k): as_text(v) for k, v in fields.items()}
        try:
            version = int(fields["v"])
            kind = fields["kind"]
            body = json.loads(fields["data"])
        except (KeyError, ValueError) as exc:
            raise ProtocolError(f"unreadable {cls.__name__}: {exc}") from None
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{cls.__name__} has protocol version {version}; this side speaks "
                f"{PROTOCOL_VERSION}: upgrade gateway and engines together"
            )
        if kind != cls.KIND:
            raise ProtocolError(f"expected a {cls.KIND!r} message, got {kind!r}")
        return cls._from_dict(body)

    @classmethod
    def _from_dict(cls, body: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        missing = [
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in body
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ProtocolError(f"{cls.__name__} lacks {', '.join(missing)}")
        # Unknown fields come from a newer minor revision: ignore them.
        return cls(**{k: v for k, v in body.items() if k in names})


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """The constant defaults of a message class's fields: not those made at each
    call (a `created_at` of time.time), which the writer's value must always set."""
    found = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            found[f.name] = f.default
        elif f.default_factory in (list, dict):
            found[f.name] = f.default_factory()
    return found


def as_text(value: Any) -> str:
    """A Redis reply as str: clients without decode_responses return bytes."""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class WorkItem(Message):
    """A request as the gateway queues it; the engine tokenizes and validates."""

    KIND: ClassVar[str] = "work"

    request_id: str
    model: str
    # Exactly one of prompt (completions), messages (chat) or prompt_token_ids.
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    # SamplingParams fields (max_tokens, temperature, top_p, top_k, seed, stop,
    # stop_token_ids, ignore_eos, presence_penalty, frequency_penalty, logit_bias as
    # [token id, bias] pairs), validated by the engine.
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int = PRIORITY_NORMAL
    # Unix seconds: when the gateway queued it, and when it must be done by.
    created_at: float = field(default_factory=time.time)
    deadline: float | None = None
    # The gateway's estimate, for the queued-tokens counter the autoscaler reads.
    estimated_prompt_tokens: int = 0
    # The client chose sampling["max_tokens"]: a prompt that leaves less room in
    # the context is refused (context_length_exceeded), as OpenAI does. False: it
    # is the gateway's default, and generation stops where the context ends.
    max_tokens_given: bool = False
    # The prefix cache's salt (the engine's Request.cache_salt); None: shared.
    cache_salt: str | None = None
    # Chat only, vLLM's options of the template's rendering: the assistant's turn
    # opened, or the last message left open to go on with; more template variables.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Checked as read, so that an entry of the wrong shape (hand-made, another
        # producer's) is answered as unreadable, not a crash of each engine that takes it.
        for name, kinds, optional in _WORK_ITEM_TYPES:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                shown = _JSON_TYPE_NAMES[kinds] + (" or null" if optional else "")
                raise ProtocolError(
                    f"work item {self.request_id!r}: {name} must be {shown}, got {value!r}"
                )
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if given != 1:
            raise ProtocolError(
                f"work item {self.request_id!r} needs exactly one of prompt, messages, "
                f"prompt_token_ids ({given} given)"
            )


# WorkItem's fields as JSON gives them: (name, types, may be null). The contents of
# messages, prompt_token_ids and sampling are the engine's to check.
_WORK_ITEM_TYPES: tuple[tuple[str, tuple[type, ...], bool], ...] = (
    ("request_id", (str,), False),
    ("model", (str,), False),
    ("prompt", (str,), True),
    ("messages", (list,), True),
    ("prompt_token_ids", (list,), True),
    ("sampling", (dict,), False),
    ("priority", (int,), False),
    ("created_at", (int, float), False),
    ("deadline", (int, float), True),
    ("estimated_prompt_tokens", (int,), False),
    ("max_tokens_given", (bool,), False),
    ("cache_salt", (str,), True),
    ("add_generation_prompt", (bool,), False),
    ("continue_final_message", (bool,), False),
    ("chat_template_kwargs", (dict,), True),
)
_JSON_TYPE_NAMES = {
    (str,): "a string",
    (list,): "a list",
    (dict,): "an object",
    (int,): "an integer",
    (int, float): "a number",
    (bool,): "true or false",
}


@dataclass
class Handoff(Message):
    """A prefilled request whose KV a PROMPT engine holds for a COMPLETION engine."""

    KIND: ClassVar[str] = "handoff"

    work: dict[str, Any]  # the WorkItem, as a dict (see .work_item)
    prompt_token_ids: list[int]
    # Tokens the prefill sampled (already sent to the client).
    first_token_ids: list[int]
    # Where the KV is: the PROMPT engine's KV server, the handle to ask for, and the
    # offer's secret a fetch must present (a secret: never log a Handoff whole).
    kv_address: str
    kv_handle: str
    # Tokens of KV on offer (the prompt), and what they must match.
    num_kv_tokens: int
    fingerprint: str
    prompt_engine: str
    # Unix seconds after which the PROMPT engine frees the KV: recompute instead.
    expires_at: float
    # Prompt tokens the PROMPT engine served from its prefix cache (for usage).
    num_cached_tokens: int = 0
    # Empty from an engine older than the tokens: its KV server asks for none.
    kv_token: str = ""

    def __post_init__(self) -> None:
        # A decoder reserves and writes KV by these numbers: one that disagrees with the
        # tokens would index past its blocks, or decode on positions never written.
        def token_ids(name: str, value: Any) -> None:
            if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
            ):
                raise ProtocolError(f"handoff {name} must be a list of token ids")

        token_ids("prompt_token_ids", self.prompt_token_ids)
        token_ids("first_token_ids", self.first_token_ids)
        if not self.prompt_token_ids or not self.first_token_ids:
            raise ProtocolError("a handoff needs its prompt and its first token")
        expected = len(self.prompt_token_ids) + len(self.first_token_ids) - 1
        if self.num_kv_tokens != expected or isinstance(self.num_kv_tokens, bool):
            raise ProtocolError(
                f"handoff num_kv_tokens is {self.num_kv_tokens!r}: its tokens give {expected}"
            )
        if not isinstance(self.expires_at, int | float) or isinstance(self.expires_at, bool):
            raise ProtocolError(f"handoff expires_at must be a number, got {self.expires_at!r}")
        texts = ("kv_address", "kv_handle", "kv_token", "fingerprint", "prompt_engine")
        if not isinstance(self.work, dict) or not all(
            isinstance(getattr(self, n), str) for n in texts
        ):
            raise ProtocolError(f"a handoff's work is a mapping and its {', '.join(texts)} strings")

    @property
    def work_item(self) -> WorkItem:
        return WorkItem._from_dict(self.work)


class EventKind(StrEnum):
    TOKENS = "tokens"
    FINISH = "finish"
    ERROR = "error"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class ResponseEvent(Message):
    """One event of a request's response stream.

    `offset` is the number of output tokens sent before this event: a reader
    that has seen more skips the overlap, so an engine that resumes a request
    after another died never makes the client see a token twice.
    """

    KIND: ClassVar[str] = "event"

    event: str  # an EventKind
    offset: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" on FINISH
    usage: dict[str, int] | None = None  # a Usage on FINISH
    error_code: str | None = None  # an ErrorCode on ERROR
    error_message: str | None = None
    # The request parameter an INVALID_REQUEST refused, as the OpenAI API names it
    # ("logit_bias"); None: the prompt. Added in a minor revision: an older engine's
    # events lack it and an older gateway ignores it.
    error_param: str | None = None
    engine_id: str = ""
    # Where the request asked for logprobs: one per token of token_ids, in OpenAI's
    # chat shape: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    # "bytes"}, ...]}.
    logprobs: list[dict[str, Any]] | None = None

    @classmethod
    def tokens(
        cls,
        offset: int,
        token_ids: list[int],
        text: str,
        engine_id: str,
        logprobs: list[dict[str, Any]] | None = None,
    ):
        return cls(
            EventKind.TOKENS, offset, list(token_ids), text, engine_id=engine_id, logprobs=logprobs
        )

    @classmethod
    def finish(cls, offset: int, reason: str, usage: Usage, engine_id: str):
        return cls(
            EventKind.FINISH,
            offset,
            finish_reason=reason,
            usage=dataclasses.asdict(usage),
            engine_id=engine_id,
        )

    @classmethod
    def error(
        cls,
        code: ErrorCode,
        message: str,
        engine_id: str,
        offset: int = 0,
        param: str | None = None,
    ):
        return cls(
            EventKind.ERROR,
            offset,
            error_code=str(code),
            error_message=message,
            error_param=param,
            engine_id=engine_id,
        )

    @property
    def is_final(self) -> bool:
        return self.event in (EventKind.FINISH, EventKind.ERROR)
