"""What an engine answers for work it will not run: the error code and message.

The loop (worker.py) asks here before it runs an entry: a request the client
cancelled while it was queued, one engines kept failing, one past its deadline,
and the engine's own refusals as it adds a request (a prompt too long, bad
sampling parameters), each with the protocol's error code (docs/protocol.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.admission import ContextLengthError, PromptTooLongError
from tandem.engine.engine_output import ParameterError
from tandem.protocol import ErrorCode

CANCELLED = "the client cancelled the request"


class OtherModelError(ValueError):
    """A handoff from a prompt engine of another model that this one cannot go on from:
    the engines' fault (a rollout), not the request's."""


@dataclass(frozen=True)
class Refusal:
    code: ErrorCode
    message: str
    param: str | None = None  # the request field at fault, where one is


def redelivered(request_id: str, times: int) -> Refusal:
    return Refusal(
        ErrorCode.REDELIVERY_LIMIT,
        f"request {request_id} was given to engines {times} times and none finished it "
        "(they kept failing); not retrying",
    )


def refusal_of(exc: ValueError | TypeError) -> Refusal:
    """The answer to the engine's refusal to add a request (ValueErrors and the
    TypeErrors of a wrongly typed field), by the most specific kind."""
    if isinstance(exc, OtherModelError):
        return Refusal(ErrorCode.ENGINE_ERROR, str(exc))
    if isinstance(exc, PromptTooLongError):
        return Refusal(ErrorCode.PROMPT_TOO_LONG, str(exc))
    if isinstance(exc, ContextLengthError):
        return Refusal(ErrorCode.CONTEXT_LENGTH_EXCEEDED, str(exc))
    if isinstance(exc, ParameterError):
        return Refusal(ErrorCode.INVALID_REQUEST, str(exc), exc.param)
    return Refusal(ErrorCode.INVALID_REQUEST, str(exc))
