"""Operations endpoints: liveness, readiness, Prometheus metrics.

Open to probes and scrapers, also when API keys are on; ``auth.ops_token`` puts them behind
a token of their own (never a client's API key).
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST


def _ops_token(request: Request) -> None:
    auth = request.app.state.gateway.settings.auth
    token = auth.ops_token if auth is not None else None
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(401, "ops token required (Authorization: Bearer ...)",
                            headers={"www-authenticate": "Bearer"})


router = APIRouter(dependencies=[Depends(_ops_token)])


@router.get("/health")
async def health() -> Response:
    """The process is alive (says nothing about the replicas)."""
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Ready when every model has an available replica, or none at all while scale from zero
    holds its requests (the gateway must take them: they are what scales it up), and the
    gateway is not draining."""
    gateway = request.app.state.gateway
    models = {name: sum(r.available for r in model.replicas)
              for name, model in gateway.models.items()}
    held = gateway.settings.autoscale.scale_from_zero.enabled
    ok = not gateway.draining and all(
        n or (held and not gateway.models[name].replicas) for name, n in models.items())
    return JSONResponse({"ready": ok, "draining": gateway.draining,
                         "available_replicas": models},
                        status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """This process's metrics; under --workers N, the totals of all workers."""
    return Response(await request.app.state.gateway.metrics.scrape(),
                    media_type=CONTENT_TYPE_LATEST)
