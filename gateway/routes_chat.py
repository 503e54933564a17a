"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from tandem.gateway.dependencies import Caller
from tandem.gateway.errors import ERROR_RESPONSES
from tandem.gateway.jobs import job_headers
from tandem.gateway.schemas import ChatCompletion, ChatCompletionRequest
from tandem.gateway.service import service_of

router = APIRouter()

# With stream=true: server-sent events (OpenAPI < 3.2: the schema describes one
# event). Each `data` is a chunk as JSON, an error body, or the final [DONE].
SSE_CONTENT: dict[str, Any] = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {
                "data": {
                    "type": "string",
                    "description": "A chunk (JSON), an error body (JSON), or [DONE]",
                },
                "event": {"type": "string"},
            },
            "required": ["data"],
        }
    }
}


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        200: {
            "model": ChatCompletion,
            "description": "The completion; with stream=true, server-sent chat.completion.chunk"
            " events ending with data: [DONE]",
            "content": SSE_CONTENT,
        },
        **ERROR_RESPONSES,
    },
    summary="Create a chat completion",
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, caller: Caller
) -> Response:
    service = service_of(request)
    job = service.jobs.chat(body, job_headers(request.headers), caller)
    return await service.serve(request, caller, job)
