"""``GET /v1/models``: the served models, with the context window clients can use."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica

router = APIRouter()

CREATED = 1700000000


def model_window(model: ServedModel, replicas: list[Replica] | None = None) -> int | None:
    """The largest window any replica offers: longer requests are routed to that replica."""
    replicas = model.replicas if replicas is None else replicas
    windows = [w for w in (model.window(r) for r in replicas) if w is not None]
    return max(windows) if windows else None


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """Every name served: the models' own, their aliases and the adapters the engines list
    (with ``parent``, as vLLM lists them)."""
    names = request.app.state.gateway.admitter.names
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": CREATED, "owned_by": "llm-gateway",
         "root": model.name, "parent": parent,
         "max_model_len": model_window(model, model.replicas_for(name))}
        for name, model, parent in names.listed()]})
