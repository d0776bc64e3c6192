"""Where admin-created keys live: this process (no Redis) or Redis (redis_store.py).

A store only persists and announces; the KeyRing is what requests read."""

from __future__ import annotations

from typing import Protocol

import orjson

from gateway.access.keys import ApiKey
from gateway.config import KeyLimits, ObjectiveConfig


class KeyConflict(Exception):
    """A name taken (create) or a key the admin API does not own (revoke a config key)."""


class StoreUnavailable(Exception):
    """The shared store (Redis) cannot be reached: nothing was changed."""


class KeyStore(Protocol):
    async def add(self, key: ApiKey) -> None: ...

    async def remove(self, name: str) -> bool: ...


class LocalStore:
    """No Redis: keys live in this process's ring only (lost on restart, not shared)."""

    async def add(self, key: ApiKey) -> None:
        return None

    async def remove(self, name: str) -> bool:
        return False


def dump_key(key: ApiKey) -> bytes:
    return orjson.dumps({"name": key.name, "sha256": key.sha256,
                         "models": sorted(key.models) if key.models is not None else None,
                         "weight": key.weight, "limits": key.limits.model_dump(),
                         "created_at": key.created_at,
                         "objective": key.objective.model_dump() if key.objective else None,
                         "max_priority": key.max_priority})


def load_key(raw: str | bytes) -> ApiKey | None:
    """A stored key, or None if the entry is malformed (skipped, never fatal)."""
    try:
        data = orjson.loads(raw)
        return ApiKey(str(data["name"]), str(data["sha256"]).lower(),
                      frozenset(data["models"]) if data.get("models") is not None else None,
                      float(data.get("weight", 1.0)), KeyLimits(**(data.get("limits") or {})),
                      "admin", float(data.get("created_at", 0.0)),
                      ObjectiveConfig(**data["objective"]) if data.get("objective") else None,
                      data.get("max_priority"))
    except (ValueError, KeyError, TypeError):
        return None
