"""Admin API: see the fleet, add, remove, drain and undrain replicas at runtime.

Protected by its own bearer token (``admin_token``), separate from client credentials;
without a configured token every admin route answers 404, as if it did not exist.
Removing or draining a replica takes it out of rotation; its in-flight streams finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.canary.report import CanaryError, judge_model
from gateway.config import Engine
from gateway.fleet.replica import Replica

router = APIRouter(prefix="/admin")


def _authorized(request: Request) -> None:
    token = request.app.state.gateway.settings.admin_token
    if token is None:
        raise HTTPException(404, "Not Found")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(401, "admin token required (Authorization: Bearer ...)",
                            headers={"www-authenticate": "Bearer"})


class NewReplica(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    url: str = Field(pattern=r"^https?://")
    engine: Engine = "vllm"
    pool: str | None = None  # default: the model's first pool
    name: str | None = Field(None, min_length=1, max_length=200)
    max_model_len: int | None = Field(None, ge=1)


def _describe(gateway: Any, replica: Replica) -> dict[str, Any]:
    load = gateway.ledger.load(replica.name)
    return {"name": replica.name, "url": replica.url, "engine": replica.engine,
            "model": replica.model, "pool": replica.pool, "state": replica.state,
            "healthy": replica.healthy, "draining": replica.draining,
            "ejected_until": replica.ejected_until if replica.ejected else None,
            "max_model_len": replica.max_model_len,
            "max_concurrent_requests": replica.max_concurrent_requests,
            "outstanding_tokens": load.outstanding_tokens, "in_flight": load.in_flight,
            "engine_signals": _signals(replica)}


def _signals(replica: Replica) -> dict[str, Any] | None:
    """What the engine last said of itself on /metrics (None: never scraped)."""
    signals = replica.signals
    if signals is None or not signals.scraped_at:
        return None
    return {"running": signals.running, "waiting": signals.waiting,
            "kv_usage": signals.kv_usage,
            "age_seconds": round(time.monotonic() - signals.scraped_at, 3)}


def _replica(request: Request, name: str) -> Replica:
    try:
        return request.app.state.gateway.replica(name)
    except KeyError:
        raise HTTPException(404, f"no replica named {name!r}") from None


@router.get("/replicas", dependencies=[Depends(_authorized)])
async def list_replicas(request: Request) -> dict[str, Any]:
    gateway = request.app.state.gateway
    return {"replicas": [_describe(gateway, r) for r in gateway.replicas]}


@router.post("/replicas", status_code=201, dependencies=[Depends(_authorized)])
async def add_replica(request: Request, new: NewReplica) -> dict[str, Any]:
    gateway = request.app.state.gateway
    if new.model not in gateway.models:
        raise HTTPException(404, f"no model named {new.model!r}")
    pool = new.pool or gateway.models[new.model].pools[0].name
    try:
        replica = await gateway.add_replica(new.model, pool, new.url, new.engine, new.name,
                                            new.max_model_len)
    except KeyError as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from None
    return _describe(gateway, replica)


@router.delete("/replicas/{name}", dependencies=[Depends(_authorized)])
async def remove_replica(request: Request, name: str) -> dict[str, Any]:
    gateway = request.app.state.gateway
    _replica(request, name)
    return _describe(gateway, gateway.remove_replica(name))


@router.post("/replicas/{name}/drain", dependencies=[Depends(_authorized)])
async def drain_replica(request: Request, name: str) -> dict[str, Any]:
    replica = _replica(request, name)
    replica.draining = True
    return _describe(request.app.state.gateway, replica)


@router.post("/replicas/{name}/undrain", dependencies=[Depends(_authorized)])
async def undrain_replica(request: Request, name: str) -> dict[str, Any]:
    replica = _replica(request, name)
    replica.draining = False
    return _describe(request.app.state.gateway, replica)


class PoolWeight(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float = Field(ge=0, allow_inf_nan=False)


def _describe_pool(model: Any, pool: Any) -> dict[str, Any]:
    return {"model": model.name, "pool": pool.name, "weight": pool.weight,
            "shadow_of": pool.shadow_of, "sample": pool.sample if pool.shadow_of else None,
            "replicas": [r.name for r in pool.replicas]}


@router.get("/models", dependencies=[Depends(_authorized)])
async def list_models(request: Request) -> dict[str, Any]:
    """Models and their pools: weights (as set now), shadows, replicas."""
    gateway = request.app.state.gateway
    return {"models": [{"name": m.name, "pools": [_describe_pool(m, p) for p in m.pools]}
                       for m in gateway.models.values()]}


@router.put("/models/{model}/pools/{pool}", dependencies=[Depends(_authorized)])
async def set_pool_weight(request: Request, model: str, pool: str,
                          new: PoolWeight) -> dict[str, Any]:
    """A pool's share of its model's traffic, now and on every instance sharing Redis."""
    gateway = request.app.state.gateway
    try:
        target = gateway.weights.set_weight(model, pool, new.weight)
    except KeyError as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from None
    with contextlib.suppress(Exception):  # Redis away: published by the next sync round
        async with asyncio.timeout(gateway.settings.redis_timeout):
            await gateway.weights.sync()
    return _describe_pool(gateway.models[model], target)


@router.get("/canary/{model}", dependencies=[Depends(_authorized)])
async def canary_verdict(request: Request, model: str, baseline: str | None = None,
                         canary: str | None = None,
                         window: float | None = Query(None, gt=0, le=7 * 86400)) -> dict[str, Any]:
    """The canary verdict over the last ``window`` seconds (gateway/canary/judge.py)."""
    gateway = request.app.state.gateway
    served = gateway.models.get(model)
    if served is None:
        raise HTTPException(404, f"no model named {model!r}")
    try:  # the statistics sort every sample: off the event loop
        result = await asyncio.to_thread(judge_model, gateway.samples, served,
                                         gateway.settings.canary.judge, baseline, canary,
                                         window)
    except CanaryError as exc:
        raise HTTPException(400, str(exc)) from None
    return {**result, "auto_rollback": gateway.settings.canary.auto_rollback,
            "rollbacks": gateway.guard.rollbacks.get(model, [])}


@router.get("/canary/{model}/disagreements", dependencies=[Depends(_authorized)])
async def canary_disagreements(request: Request, model: str) -> dict[str, Any]:
    """Shadowed pairs compared for the model, and the last ones whose outputs differ."""
    gateway = request.app.state.gateway
    if model not in gateway.models:
        raise HTTPException(404, f"no model named {model!r}")
    return gateway.agreement.report(model)


@router.get("/runtime", dependencies=[Depends(_authorized)])
async def runtime(request: Request) -> dict[str, Any]:
    """Process resources, for leak checks: tasks, file descriptors, requests inside."""
    gateway = request.app.state.gateway
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_fds = None
    return {"pid": os.getpid(), "asyncio_tasks": len(asyncio.all_tasks()),
            "open_fds": open_fds, "active_requests": gateway.active_requests,
            "draining": gateway.draining, "shadow_in_flight": gateway.shadows.in_flight,
            "queued": {name: gateway.router.queued(name) for name in gateway.models}}
