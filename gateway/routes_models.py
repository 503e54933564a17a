"""GET /v1/models and /v1/models/{model}: the served models, in the OpenAI list format.

Served: with live engines, or declared by a controller while scaled to zero.

A key sees only the models it may use.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException

from tandem.gateway.auth import check_model
from tandem.gateway.dependencies import Caller
from tandem.gateway.errors import ERROR_RESPONSES, model_not_found
from tandem.gateway.schemas import ModelCard, ModelList
from tandem.gateway.service import service_of
from tandem.registry_entry import EngineInfo

router = APIRouter()

_ERRORS = {status: ERROR_RESPONSES[status] for status in (401, 403, 404, 500, 503)}


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS, summary="List models")
async def list_models(request: Request, caller: Caller) -> ModelList:
    directory = service_of(request).directory
    models = await directory.models()
    return ModelList(
        data=[_card(name, models[name]) for name in await directory.served_for(caller)]
    )


@router.get("/v1/models/", include_in_schema=False)
async def stray_slash() -> None:
    # Else {model:path} below matches "" and answers "The model '' does not exist":
    # a stray trailing slash is a plain 404, as on every route (create_app).
    raise HTTPException(404)


@router.get(
    "/v1/models/{model:path}",
    response_model=ModelCard,
    responses=_ERRORS,
    summary="Retrieve a model (names may contain slashes)",
)
async def retrieve_model(model: str, request: Request, caller: Caller) -> ModelCard:
    # First: a key limited to some models learns nothing of the others, served or not.
    check_model(caller, model)
    directory = service_of(request).directory
    if not await directory.is_served(model):
        served = await directory.served_for(caller)
        raise model_not_found(model, served, limited=caller.models is not None)
    return _card(model, (await directory.models()).get(model, []))


def _card(name: str, engines: list[EngineInfo]) -> ModelCard:
    # "created": when its longest-running engine started; with none yet (declared, at
    # zero or loading), now, as vLLM says of every model (0 read as 1970).
    started = min((e.started_at for e in engines), default=time.time())
    return ModelCard(id=name, created=int(started))
