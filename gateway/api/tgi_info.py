"""``GET /info``: TGI's Info of the default model (what TGI clients read for limits)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway import __version__
from gateway.api.openai_models import model_window
from gateway.protocol.errors import Api, GatewayError

router = APIRouter()


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    gateway = request.app.state.gateway
    try:
        model = gateway.admitter.model_for(None, Api.TGI)
    except GatewayError as error:
        return JSONResponse(error.tgi_body(), status_code=error.tgi_status())
    window = model_window(model)
    input_limits = [r.max_input_tokens for r in model.replicas if r.max_input_tokens]
    return JSONResponse({
        "model_id": model.name, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": 128 * max(len(model.replicas), 1),
        "max_best_of": 1, "max_stop_sequences": 4,
        "max_input_tokens": max(input_limits) if input_limits else (window - 1 if window else None),
        "max_total_tokens": window, "validation_workers": 1,
        "max_client_batch_size": 1, "router": "llm-gateway", "version": __version__,
        "sha": None, "docker_label": None,
    })
