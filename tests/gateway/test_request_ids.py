"""Every answer names its request (x-request-id), an unexpected error's too: the id a
user quotes is the one the gateway's log carries."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.testclient import TestClient

from tandem.gateway.error_handlers import install_error_handlers
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.middleware import RequestObserver


def app_that_fails() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestObserver, metrics=GatewayMetrics())

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok() -> dict[str, str]:
        return {}

    return app


def test_an_unexpected_error_is_named_in_its_answer_and_the_log(caplog):
    client = TestClient(app_that_fails(), raise_server_exceptions=False)
    assert client.get("/ok").headers["x-request-id"].startswith("req_")
    with caplog.at_level(logging.ERROR, logger="tandem.gateway"):
        answer = client.get("/boom")
    assert answer.status_code == 500
    rid = answer.headers["x-request-id"]
    assert rid.startswith("req_") and rid in caplog.text
