"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica
that stored the response (gateway/fleet/response_homes.py), its answer returned as it
came. Unknown, or its replica gone: 404 in OpenAI's shape, never another replica's answer.
Reading a stored response runs no model: it takes no place in the ledger."""

from __future__ import annotations

from urllib.parse import quote

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.protocol.errors import GatewayError, UpstreamUnavailable
from gateway.protocol.responses import ResponseNotFound

router = APIRouter()

_PASSED_HEADERS = ("content-type",)


async def _to_home(request: Request, response_id: str, method: str, suffix: str = "") -> Response:
    gateway = request.app.state.gateway
    try:
        home = await gateway.response_homes.home(response_id)
        replica = next((r for r in gateway.replicas if r.name == home), None)
        if replica is None:
            raise ResponseNotFound(response_id, param="response_id")
        url = f"{replica.url}/v1/responses/{quote(response_id, safe='')}{suffix}"
        try:
            async with gateway.probe_session.request(
                    method, url, params=dict(request.query_params),
                    timeout=aiohttp.ClientTimeout(total=gateway.settings.timeouts.total)
            ) as upstream:
                body = await upstream.read()
                headers = {k: v for k, v in upstream.headers.items()
                           if k.lower() in _PASSED_HEADERS}
                headers["x-gateway-replica"] = replica.name
                return Response(body, upstream.status, headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"replica {replica.name} failed: {exc}") from None
    except GatewayError as error:
        return JSONResponse(error.openai_body(), status_code=error.status)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    return await _to_home(request, response_id, "GET")


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    return await _to_home(request, response_id, "POST", "/cancel")
