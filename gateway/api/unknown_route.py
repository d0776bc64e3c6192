"""A route the gateway does not serve is a 404 (a known route with another method, a 405)
in the shape its client parses, never a blind pass-through to an engine: Anthropic's for
``/v1/messages…``, OpenAI's for the other ``/v1/…`` and ``/v2/…`` paths, TGI's for the rest
(TGI's routes have no prefix)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gateway.protocol.errors import Api, InvalidRequest
from gateway.protocol.reasons import Reason

# What Starlette says when no route matches (404) or the method does not (405); other
# HTTPExceptions (the admin API's own answers) keep their bodies.
_ROUTING = {404: "Not Found", 405: "Method Not Allowed"}


class UnknownRoute(InvalidRequest):
    status = 404
    openai_type = "invalid_request_error"
    tgi_type = "not_found"
    code = "unknown_route"
    reason = Reason.BAD_REQUEST


class MethodNotAllowed(UnknownRoute):
    status = 405
    tgi_type = "method_not_allowed"
    code = "method_not_allowed"


def client_api(path: str) -> Api:
    if path.startswith("/v1/messages"):
        return Api.ANTHROPIC
    return Api.OPENAI if path.startswith(("/v1/", "/v2/")) else Api.TGI


async def routing_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if _ROUTING.get(exc.status_code) != exc.detail:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=exc.headers)
    kind = UnknownRoute if exc.status_code == 404 else MethodNotAllowed
    what = "unknown route" if exc.status_code == 404 else "method not allowed on"
    error = kind(f"{what}: {request.method} {request.url.path}")
    api = client_api(request.url.path)
    return Response(error.body(api), status_code=exc.status_code, headers=exc.headers,
                    media_type="application/json")
