"""The OpenAI wire format: request and response bodies, fields in the OpenAI order.

Requests forbid unknown fields (OpenAI answers "Unrecognized request argument"
too), so a misspelt parameter is an error instead of silently ignored, and
their types are strict, as OpenAI's are: `"max_tokens": "2"`, `true` for a
number or `1.0` for an integer are refused, not coerced. Fields
the OpenAI API has but Tandem does not implement are declared, so a request
that sets them to a neutral value (many clients send `tool_choice: "none"`)
passes and any other value is refused by name (jobs.py); hints that change
nothing a user can observe (`user`, `prompt_cache_key`) are accepted, unused.
Extensions (`top_k`, `priority`, `ignore_eos`, vLLM's `cache_salt`) are marked as such.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# The biggest max_tokens accepted: far beyond any context, small enough for any engine.
MAX_TOKENS_LIMIT = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
# OpenAI's seed is an int64; the engine's generator takes it modulo 2**64, where
# every int64 has its own value.
Seed = Annotated[int | None, Field(ge=-(2**63), le=2**63 - 1)]
Priority = Literal["high", "normal", "low"]
CacheSalt = Annotated[
    str | None,
    Field(
        min_length=1,
        max_length=1024,
        description="Extension (as vLLM's): prompts share cached prefixes only with "
        "prompts of the same salt.",
    ),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------ requests


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are served."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None
    # Accepted and ignored on a text part: where a cached prefix may end (the engines'
    # prefix cache finds its own).
    prompt_cache_breakpoint: dict[str, object] | None = None


class ChatMessage(BaseModel):
    """A message: the fields of OpenAI's message schemas, every role's together.

    Which role may set which field, and which values are served, is checked in
    jobs.py; a field no OpenAI message has is refused here, as OpenAI does.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    # A participant's name, passed to the chat template (most render none; some do).
    name: str | None = None
    # Assistant messages: what a past answer had besides its text. Only empty
    # values are served (no tools, no audio); annotations (a reply's citations,
    # sent back by clients that append the reply) are accepted, unused.
    refusal: str | None = None
    audio: dict[str, object] | None = None
    tool_calls: list[dict[str, object]] | None = None
    function_call: dict[str, object] | None = None
    annotations: list[dict[str, object]] | None = None
    # Tool messages: the call answered. Accepted, unused.
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    # Accepted and ignored: the gateway pads no chunk, whichever a client asks for.
    include_obfuscation: bool | None = None


# Field types the two request bodies share.
Penalty = Annotated[
    float | None,
    Field(allow_inf_nan=False, ge=-2.0, le=2.0, description="-2 to 2, as OpenAI's."),
]
LogitBias = Annotated[
    dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None,
    Field(description="Token ids (as strings) to biases in [-100, 100], as OpenAI's."),
]
Choices = Annotated[int | None, Field(ge=1, description="Choices to generate.")]
StopText = Annotated[str, Field(min_length=1)]
# OpenAI's limit. The engine takes any number (the offline LLM API allows more).
MAX_STOP_SEQUENCES = 4
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None
Temperature = Annotated[float | None, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[
    float | None,
    Field(ge=0, le=1, allow_inf_nan=False, description="0 keeps only the likeliest token."),
]
TopK = Annotated[
    int | None,
    Field(ge=-1, description="Extension: top-k sampling; 0 or -1 (vLLM's): every token."),
]
PriorityField = Annotated[
    Priority | None,
    Field(description="Extension: queue priority (or header X-Tandem-Priority)."),
]
IgnoreEos = Annotated[
    bool | None, Field(description="Extension: keep generating past end-of-sequence.")
]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str = Field(min_length=1)
    audio: dict[str, object] | None = Field(default=None, description="Not supported.")
    frequency_penalty: Penalty = None
    function_call: str | dict[str, object] | None = Field(
        default=None, description="Not supported (deprecated: tool_choice)."
    )
    functions: list[dict[str, object]] | None = Field(
        default=None, description="Not supported (deprecated: tools)."
    )
    logit_bias: LogitBias = None
    logprobs: bool | None = Field(
        default=None, description="Each token's log-probability, the model's own."
    )
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None
    # Accepted and ignored: they change nothing without tools or storage.
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = Field(default=None, description="Only ['text'].")
    moderation: dict[str, object] | None = Field(default=None, description="Not supported.")
    n: Choices = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, object] | None = Field(default=None, description="Not supported.")
    presence_penalty: Penalty = None
    # Accepted and ignored, as `user`: a cache or abuse-tracking hint changes no answer.
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, object] | None = None
    prompt_cache_retention: str | None = None  # the engines' prefix cache keeps its own
    # Strings, not OpenAI's enums: a value OpenAI adds later is refused as unsupported.
    reasoning_effort: str | None = Field(default=None, description="Only 'none'.")
    response_format: dict[str, object] | None = Field(
        default=None, description="Only {'type': 'text'}."
    )
    safety_identifier: str | None = None
    seed: Seed = None
    service_tier: str | None = Field(default=None, description="Only 'auto' or 'default'.")
    stop: Stop = None
    store: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = None
    tool_choice: str | dict[str, object] | None = Field(default=None, description="Not supported.")
    tools: list[dict[str, object]] | None = Field(default=None, description="Not supported.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=20, description="Most likely tokens a position lists (logprobs)."
    )
    top_p: TopP = None
    user: str | None = None
    verbosity: str | None = Field(default=None, description="Only 'medium' (the default).")
    web_search_options: dict[str, object] | None = Field(default=None, description="Not supported.")
    # Extensions.
    top_k: TopK = None
    priority: PriorityField = None
    ignore_eos: IgnoreEos = None
    cache_salt: CacheSalt = None
    add_generation_prompt: bool | None = Field(
        default=None,
        description="Extension (vLLM's): the template opens the assistant's turn (default true).",
    )
    continue_final_message: bool | None = Field(
        default=None,
        description="Extension (vLLM's): the prompt ends inside the last message, which the "
        "model goes on with (with add_generation_prompt false).",
    )
    chat_template_kwargs: dict[str, object] | None = Field(
        default=None, description="Extension (vLLM's): more variables for the chat template."
    )


class CompletionRequest(_Request):
    model: str = Field(min_length=1)
    # A string or token ids, or a batch of either: n choices for each prompt (prompts.py).
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    best_of: int | None = Field(default=None, description="Only 1 (or n) is supported.")
    echo: bool | None = Field(default=None, description="Not supported.")
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=5,
        description="Most likely tokens a position lists, with each token's log-probability.",
    )
    max_tokens: MaxTokens | None = None
    n: Choices = None
    presence_penalty: Penalty = None
    seed: Seed = None
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = Field(default=None, description="Not supported.")
    temperature: Temperature = None
    top_p: TopP = None
    user: str | None = None
    # Extensions.
    top_k: TopK = None
    priority: PriorityField = None
    ignore_eos: IgnoreEos = None
    cache_salt: CacheSalt = None


# ----------------------------------------------------------------- responses

FinishReason = Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs: one entry per token of its content."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's logprobs: lists parallel over its tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A completion, or (with finish_reason null, usage absent) one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
