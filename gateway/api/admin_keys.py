"""Admin API for API keys: create (the secret is shown once), list (never a secret or its
hash), revoke. Behind the admin token like the other admin routes; with ``redis_url`` keys
created here are shared by every instance and a revocation reaches them within a second."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.access.store import KeyConflict, StoreUnavailable
from gateway.access.control import AccessControl
from gateway.api.admin import _authorized
from gateway.api.admin_view import admin_view
from gateway.config import KEY_NAME_PATTERN, KeyLimits, ObjectiveConfig

router = APIRouter(prefix="/admin/keys", dependencies=[Depends(_authorized)])


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=KEY_NAME_PATTERN)
    models: list[str] | None = Field(None, max_length=1000)
    weight: float = Field(1.0, gt=0, le=1000)
    limits: KeyLimits = KeyLimits()
    objective: ObjectiveConfig | None = None
    max_priority: int | None = Field(None, ge=-100, le=100)


def _access(request: Request) -> AccessControl:
    access = admin_view(request).access
    if not access.enabled:
        raise HTTPException(404, "API keys are off (no `auth` section in the config)")
    return access


@router.get("")
async def list_keys(request: Request) -> dict[str, Any]:
    return {"keys": [k.describe() for k in _access(request).keys.all()]}


@router.post("", status_code=201)
async def create_key(request: Request, new: NewKey) -> dict[str, Any]:
    access = _access(request)
    unknown = sorted(set(new.models or ()) - set(admin_view(request).fleet.models))
    if unknown:
        raise HTTPException(422, f"unknown models {unknown}")
    try:
        key, secret = await access.create(new.name, new.models, new.weight, new.limits,
                                          new.objective, new.max_priority)
    except KeyConflict as exc:
        raise HTTPException(409, str(exc)) from None
    except StoreUnavailable as exc:
        raise HTTPException(503, str(exc)) from None
    return {**key.describe(), "secret": secret}


@router.delete("/{name}")
async def revoke_key(request: Request, name: str) -> dict[str, Any]:
    access = _access(request)
    try:
        key = await access.revoke(name)
    except KeyConflict as exc:
        raise HTTPException(409, str(exc)) from None
    except StoreUnavailable as exc:
        raise HTTPException(503, str(exc)) from None
    if key is None:
        raise HTTPException(404, "no API key with that name")
    return {**key.describe(), "revoked": True}
