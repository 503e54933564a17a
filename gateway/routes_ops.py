"""Probes and metrics: /healthz (the event loop answers), /readyz (Redis reachable), /metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.gateway.errors import ERROR_RESPONSES, unavailable
from tandem.gateway.service import service_of

router = APIRouter()

# How long a scrape waits for the engine registry before it answers without it.
METRICS_REDIS_TIMEOUT_S = 1.0


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: Redis reachable", responses={503: ERROR_RESPONSES[503]})
async def readyz(request: Request) -> JSONResponse:
    service = service_of(request)
    # Time-bounded: a paused Redis accepts the connection and never answers, and
    # the client's socket timeout (5 s, tried 3 times) outlasts a probe's.
    problem = await service.broker.unready(service.settings.readyz_timeout_s)
    service.readiness.saw(problem)
    if problem is not None:
        # Not a GatewayError: a failing probe is not a rejected request.
        return unavailable(problem).response()
    return JSONResponse({"status": "ready"})


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    service = service_of(request)
    # Never held up by Redis: while it is away the counters of the 503s are what an
    # operator needs, and a scrape that failed read as the gateway being down.
    try:
        async with asyncio.timeout(METRICS_REDIS_TIMEOUT_S):
            await service.scrape.refresh()
    except TimeoutError:
        service.metrics.redis_up(False)
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
