"""create_app: one gateway replica's ASGI app, with everything it holds on app.state."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from tandem import __version__
from tandem.gateway import routes_chat, routes_completions, routes_models, routes_ops
from tandem.gateway.auth import ENV_VAR, KeyStore
from tandem.gateway.error_handlers import install_error_handlers
from tandem.gateway.head_requests import HeadAsGet
from tandem.gateway.load_shedding import LoadShedder
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.middleware import BodyLimit, RequestObserver
from tandem.gateway.quota import RATE_LIMIT_HEADERS
from tandem.gateway.request_target import AbsoluteForm
from tandem.gateway.server import graceful_seconds
from tandem.gateway.service import GatewayService
from tandem.gateway.settings import GatewaySettings

_DESCRIPTION = """OpenAI-compatible API of Tandem. Extensions: `top_k`, `priority`
("high" | "normal" | "low", or header `X-Tandem-Priority`), `ignore_eos`; headers
`X-Tandem-Timeout` (seconds, lowers the server's request timeout) and
`Idempotency-Key` (a retry attaches to the first attempt's work)."""


# How long a read that decides a request's admission waits for Redis' answer.
READ_TIMEOUT_S = 1.0


def create_app(
    settings: GatewaySettings,
    *,
    key_store: KeyStore | None = None,
    redis_client: aioredis.Redis | None = None,
) -> FastAPI:
    """The gateway app. Raises ValueError on a bad configuration (no keys, a bad file).

    key_store: default from settings.api_keys_file and $TANDEM_API_KEYS (or open
    with settings.no_auth). redis_client: default one client (a bounded,
    blocking pool) on settings.redis_url, closed with the app; a client passed
    in stays the caller's.
    """
    if key_store is None:
        if settings.no_auth:
            key_store = KeyStore.open()
        else:
            key_store = KeyStore.load(settings.api_keys_file, os.environ.get(ENV_VAR))
    client = redis_client if redis_client is not None else _redis_client(settings)
    # The reads that decide admission (Redis' run_id, the served models, the queues'
    # lengths) on a pool of their own, each answer within READ_TIMEOUT_S: a paused
    # Redis held each a whole socket timeout (5 s), 10 s to a 503 whatever the
    # request's deadline. Their own pool: streams holding the main one in XREAD BLOCK
    # under load do not time them out while Redis answers.
    reads = client if redis_client is not None else _redis_client(settings, READ_TIMEOUT_S)
    metrics = GatewayMetrics()
    service = GatewayService(settings, key_store, client, metrics, reads=reads)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.replicas.start()
        try:
            yield
        finally:
            await service.cancels.close()
            await service.replicas.close()
            if redis_client is None:
                for owned in (client, reads):
                    await owned.aclose()
                    await owned.connection_pool.disconnect()

    app = FastAPI(
        title="Tandem gateway",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=lifespan,
        # The interactive docs load scripts from a CDN: not on a serving host.
        docs_url=None,
        redoc_url=None,
        # A stray trailing slash gets a JSON 404, not a 307 to an absolute URL
        # (the wrong host behind a load balancer) with an empty body.
        redirect_slashes=False,
    )
    app.state.gateway = service
    install_error_handlers(app)
    for module in (routes_chat, routes_completions, routes_models, routes_ops):
        app.include_router(module.router)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        on_reject=metrics.rejected,
        timeout_s=settings.body_timeout_s,
        authenticate=key_store.caller,
    )
    # Outside the body limit: a request shed reads no body (nor checks its key).
    app.add_middleware(LoadShedder, limit=settings.answering_limit, on_reject=metrics.rejected)
    # Added after the body limit, so outside it: it also sees the body limit's 413s.
    app.add_middleware(
        RequestObserver, metrics=metrics, shutdown_s=graceful_seconds(settings.shutdown_timeout)
    )
    if settings.allowed_origins:
        # Outermost: a browser's preflight (OPTIONS, no key) is answered here, and every
        # answer, a 401 or 413 of the body limit's included, carries the headers a
        # browser needs to show it to the page.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # Authorization, the SDKs' x-stainless-*, Idempotency-Key
            # x-request-id: the SDKs' `_request_id`, and `request_id` on their errors.
            expose_headers=[
                "Retry-After",
                "retry-after-ms",
                "x-should-retry",
                "x-request-id",
                *RATE_LIMIT_HEADERS,
            ],
            max_age=600,
        )
    app.add_middleware(HeadAsGet)  # everything inside sees a GET
    app.add_middleware(AbsoluteForm)  # outermost: everything inside sees the path alone
    open_access = key_store.open_access
    app.openapi = lambda: _openapi(app, open_access=open_access)  # type: ignore[method-assign]
    return app


def _redis_client(settings: GatewaySettings, answer_within: float | None = None) -> aioredis.Redis:
    # Blocking pool: past max_connections a request waits for a connection
    # instead of failing with "Too many connections" (redis-py's default pool).
    # A command that meets a dead connection (Redis restarted, a proxy closed it)
    # reconnects and runs again, twice at most: without, every pooled connection
    # failed one request with a 503 after Redis came back. Not one that timed out:
    # a paused Redis held each command three socket timeouts (15 s), and reads
    # ended 30 s into an outage where the docs say 10. answer_within: the socket's
    # timeouts (connect, and each answer), for the admission reads' own pool.
    timeouts = {} if answer_within is None else {
        "socket_timeout": answer_within, "socket_connect_timeout": answer_within
    }  # fmt: skip
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=5,
        **timeouts,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 2, supported_errors=(RedisConnectionError,)
        ),
    )
    return aioredis.Redis(connection_pool=pool)


def _openapi(app: FastAPI, *, open_access: bool) -> dict[str, Any]:
    """FastAPI's schema, minus its 422 (validation errors are answered 400, which
    every route documents with the OpenAI error body), and minus the bearer
    scheme when the gateway runs without keys."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
            if open_access:
                operation.pop("security", None)
    components = schema.get("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if open_access:
        components.pop("securitySchemes", None)
    app.openapi_schema = schema
    return schema
