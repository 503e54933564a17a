"""FastAPI dependencies shared by the routes: the caller of a request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tandem.gateway.auth import ApiKey
from tandem.gateway.middleware import CALLER
from tandem.gateway.service import service_of

# Declares the bearer scheme in the OpenAPI schema; the check itself is the
# key store's (auto_error=False: FastAPI's own 403 is not the OpenAI 401).
_bearer = HTTPBearer(auto_error=False, description="An API key: Authorization: Bearer <key>")


async def caller_of(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ApiKey:
    known = request.scope.get("state", {}).get(CALLER)  # BodyLimit's, for a POST
    if isinstance(known, ApiKey):
        return known
    return service_of(request).key_store.caller(request.headers.getlist("authorization"))


# A route parameter typed Caller is the authenticated ApiKey (401 otherwise).
Caller = Annotated[ApiKey, Depends(caller_of)]
