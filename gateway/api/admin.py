"""Admin API: see the fleet, add, remove, drain and undrain replicas at runtime.

Protected by its own bearer token (``admin_token``), separate from client credentials;
without a configured token every admin route answers 404, as if it did not exist.
Removing or draining a replica takes it out of rotation; its in-flight streams finish.
The routes see the gateway through ``AdminView`` (gateway/api/admin_view.py) only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.admin_view import AdminView, admin_view
from gateway.canary.verdict_plan import CanaryError, judge_records, plan, since
from gateway.config import Engine
from gateway.fleet.replica import Replica
from gateway.fleet.role import Role

router = APIRouter(prefix="/admin")


def _bearer(request: Request) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given if scheme.lower() == "bearer" else None


def _matches(given: str | None, token: str | None) -> bool:
    return (given is not None and token is not None
            and secrets.compare_digest(given.encode(), token.encode()))


def _authorized(request: Request) -> None:
    token = admin_view(request).admin_token
    if token is None:
        raise HTTPException(404, "Not Found")
    if not _matches(_bearer(request), token):
        raise HTTPException(401, "admin token required (Authorization: Bearer ...)",
                            headers={"www-authenticate": "Bearer"})


def _may_read_verdict(request: Request, given: str | None = None) -> None:
    """The admin token, or the read-only ``canary.gate_token`` (as a bearer, or ``given``:
    a Flagger webhook's metadata.token, since Flagger sends no headers)."""
    view = admin_view(request)
    gate = view.gate_token
    if view.admin_token is None and gate is None:
        raise HTTPException(404, "Not Found")
    bearer = _bearer(request)
    if not (_matches(bearer, view.admin_token) or _matches(bearer, gate)
            or _matches(given, gate)):
        raise HTTPException(401, "admin or canary gate token required (Authorization: "
                            "Bearer ...)", headers={"www-authenticate": "Bearer"})


class NewReplica(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    url: str = Field(pattern=r"^https?://")
    engine: Engine = "vllm"
    pool: str | None = None  # default: the model's first pool
    name: str | None = Field(None, min_length=1, max_length=200)
    max_model_len: int | None = Field(None, ge=1)
    role: Role = Role.BOTH


def _describe(view: AdminView, replica: Replica) -> dict[str, Any]:
    load = view.load(replica.name)
    return {"name": replica.name, "url": replica.url, "engine": replica.engine,
            "model": replica.model, "pool": replica.pool, "role": replica.role,
            "state": replica.state,
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
        return admin_view(request).fleet.replica(name)
    except KeyError:
        raise HTTPException(404, f"no replica named {name!r}") from None


@router.get("/replicas", dependencies=[Depends(_authorized)])
async def list_replicas(request: Request) -> dict[str, Any]:
    view = admin_view(request)
    return {"replicas": [_describe(view, r) for r in view.fleet.replicas]}


@router.post("/replicas", status_code=201, dependencies=[Depends(_authorized)])
async def add_replica(request: Request, new: NewReplica) -> dict[str, Any]:
    view = admin_view(request)
    if new.model not in view.fleet.models:
        raise HTTPException(404, f"no model named {new.model!r}")
    pool = new.pool or view.fleet.models[new.model].pools[0].name
    try:
        replica = await view.fleet.add_replica(new.model, pool, new.url, new.engine, new.name,
                                               new.max_model_len, new.role)
    except KeyError as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from None
    return _describe(view, replica)


@router.delete("/replicas/{name}", dependencies=[Depends(_authorized)])
async def remove_replica(request: Request, name: str) -> dict[str, Any]:
    view = admin_view(request)
    _replica(request, name)
    return _describe(view, view.fleet.remove_replica(name))


@router.post("/replicas/{name}/drain", dependencies=[Depends(_authorized)])
async def drain_replica(request: Request, name: str) -> dict[str, Any]:
    replica = _replica(request, name)
    replica.draining = True
    return _describe(admin_view(request), replica)


@router.post("/replicas/{name}/undrain", dependencies=[Depends(_authorized)])
async def undrain_replica(request: Request, name: str) -> dict[str, Any]:
    replica = _replica(request, name)
    replica.draining = False
    return _describe(admin_view(request), replica)


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
    return {"models": [{"name": m.name, "pools": [_describe_pool(m, p) for p in m.pools]}
                       for m in admin_view(request).fleet.models.values()]}


@router.put("/models/{model}/pools/{pool}", dependencies=[Depends(_authorized)])
async def set_pool_weight(request: Request, model: str, pool: str,
                          new: PoolWeight) -> dict[str, Any]:
    """A pool's share of its model's traffic, now and on every instance sharing Redis."""
    view = admin_view(request)
    try:
        target = view.weights.set_weight(model, pool, new.weight)
    except KeyError as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except ValueError as exc:
        raise HTTPException(409, str(exc)) from None
    with contextlib.suppress(Exception):  # Redis away: published by the next sync round
        async with asyncio.timeout(view.redis_timeout):
            await view.weights.sync()
    return _describe_pool(view.fleet.models[model], target)


async def _verdict(request: Request, model: str, baseline: str | None, canary: str | None,
                   reference: str | None, window: float | None) -> dict[str, Any]:
    view = admin_view(request)
    served = view.fleet.models.get(model)
    if served is None:
        raise HTTPException(404, f"no model named {model!r}")
    config = view.canary.judge
    try:
        judged = plan(served, config, baseline, canary, reference)
    except CanaryError as exc:
        raise HTTPException(400, str(exc)) from None
    window = window or config.window
    records, source = await view.samples.read(judged, since(window))
    # The statistics sort every sample: off the event loop.
    result = await asyncio.to_thread(judge_records, judged, records, config, window)
    return {**result, "samples": source,
            "auto_rollback": view.canary.auto_rollback,
            "rollbacks": view.rollbacks.get(model, [])}


@router.get("/canary/{model}", dependencies=[Depends(_may_read_verdict)])
async def canary_verdict(request: Request, model: str, baseline: str | None = None,
                         canary: str | None = None, reference: str | None = None,
                         window: float | None = Query(None, gt=0, le=7 * 86400)) -> dict[str, Any]:
    """The canary verdict over the last ``window`` seconds (gateway/canary/verdict_plan.py)."""
    return await _verdict(request, model, baseline, canary, reference, window)


class GateCall(BaseModel):
    """A Flagger webhook's payload; the gateway reads only ``metadata`` (strings)."""

    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    namespace: str | None = None
    phase: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


GATE_OPTIONS = ("baseline", "canary", "reference", "window")


@router.post("/canary/{model}/gate")
async def canary_gate(request: Request, model: str, call: GateCall | None = None,
                      baseline: str | None = None, canary: str | None = None,
                      reference: str | None = None,
                      window: float | None = Query(None, gt=0, le=7 * 86400)) -> JSONResponse:
    """A gate for pipelines (Flagger's rollout webhook): 200 when the canary passes, 412
    otherwise, with the verdict in the body. Options in the query or the webhook's
    metadata (baseline, canary, reference, window)."""
    meta = call.metadata if call is not None else {}
    _may_read_verdict(request, meta.get("token"))
    unknown = set(meta) - {"token", *GATE_OPTIONS}
    if unknown:
        raise HTTPException(400, f"unknown metadata: {', '.join(sorted(unknown))} (known: "
                            f"token, {', '.join(GATE_OPTIONS)})")
    if "window" in meta:
        try:
            window = float(meta["window"])
        except ValueError:
            raise HTTPException(400, "metadata.window must be seconds (a number)") from None
        if not 0 < window <= 7 * 86400:
            raise HTTPException(400, "metadata.window must be in (0, 604800] seconds")
    result = await _verdict(request, model, meta.get("baseline", baseline),
                            meta.get("canary", canary), meta.get("reference", reference), window)
    failed = [m["metric"] for m in result["metrics"] if m["class"] == "fail"]
    body = {"verdict": result["verdict"], "score": result["score"], "model": model,
            "baseline": result["baseline"], "canary": result["canary"],
            "requests": result["requests"], "failed": failed, "samples": result["samples"]}
    return JSONResponse(body, status_code=200 if result["verdict"] == "pass" else 412)


@router.get("/canary/{model}/disagreements", dependencies=[Depends(_authorized)])
async def canary_disagreements(request: Request, model: str) -> dict[str, Any]:
    """Shadowed pairs compared for the model, and the last ones whose outputs differ."""
    view = admin_view(request)
    if model not in view.fleet.models:
        raise HTTPException(404, f"no model named {model!r}")
    return view.agreement.report(model)


@router.get("/runtime", dependencies=[Depends(_authorized)])
async def runtime(request: Request) -> dict[str, Any]:
    """Process resources, for leak checks: tasks, file descriptors, requests inside."""
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_fds = None
    return {"pid": os.getpid(), "asyncio_tasks": len(asyncio.all_tasks()),
            "open_fds": open_fds, **admin_view(request).activity()}
