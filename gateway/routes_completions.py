"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from tandem.gateway.dependencies import Caller
from tandem.gateway.errors import ERROR_RESPONSES
from tandem.gateway.jobs import job_headers
from tandem.gateway.routes_chat import SSE_CONTENT
from tandem.gateway.schemas import Completion, CompletionRequest
from tandem.gateway.service import service_of

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        200: {
            "model": Completion,
            "description": "The completion; with stream=true, server-sent text_completion"
            " events ending with data: [DONE]",
            "content": SSE_CONTENT,
        },
        **ERROR_RESPONSES,
    },
    summary="Create a completion",
)
async def create_completion(body: CompletionRequest, request: Request, caller: Caller) -> Response:
    service = service_of(request)
    job = service.jobs.completion(body, job_headers(request.headers), caller)
    return await service.serve(request, caller, job)
