"""``GET /v1/models``: the served models, with the context window clients can use."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.fleet.model import ServedModel

router = APIRouter()

CREATED = 1700000000


def model_window(model: ServedModel) -> int | None:
    """The largest window any replica offers: longer requests are routed to that replica."""
    windows = [w for w in (model.window(r) for r in model.replicas) if w is not None]
    return max(windows) if windows else None


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    models = request.app.state.gateway.models.values()
    return JSONResponse({"object": "list", "data": [
        {"id": m.name, "object": "model", "created": CREATED, "owned_by": "llm-gateway",
         "root": m.name, "parent": None, "max_model_len": model_window(m)} for m in models]})
