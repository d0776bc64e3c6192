"""The keys a gateway accepts: those of the config file plus those created through the admin
API (kept in Redis when it is configured, see key_store.py), looked up by hash."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field

from gateway.config import ApiKeyConfig, KeyLimits, ObjectiveConfig
from gateway.protocol.request import Caller


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    sha256: str  # lower-case hex
    models: frozenset[str] | None
    weight: float
    limits: KeyLimits
    source: str = "config"  # "config" or "admin"
    created_at: float = field(default_factory=time.time)
    objective: ObjectiveConfig | None = None  # its requests' defaults (None: none set)
    max_priority: int | None = None  # the highest priority it may ask for (None: its own)

    @property
    def priority_ceiling(self) -> int:
        """The highest ``x-gateway-priority`` its requests may send."""
        if self.max_priority is not None:
            return self.max_priority
        own = self.objective.priority if self.objective is not None else None
        return own if own is not None else 0

    @property
    def caller(self) -> Caller:
        return Caller(self.name, self.weight)

    @property
    def limited(self) -> bool:
        limits = self.limits
        return (limits.requests_per_minute is not None or limits.tokens_per_minute is not None
                or limits.concurrent_requests is not None)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def describe(self) -> dict:
        """What the admin API lists: never the secret, never its hash."""
        return {"name": self.name, "models": sorted(self.models) if self.models else None,
                "weight": self.weight, "limits": self.limits.model_dump(),
                "objective": self.objective.model_dump() if self.objective else None,
                "max_priority": self.max_priority,
                "source": self.source, "created_at": self.created_at}

    @classmethod
    def from_config(cls, config: ApiKeyConfig, source: str = "config",
                    created_at: float | None = None) -> "ApiKey":
        return cls(config.name, config.sha256.lower(),
                   frozenset(config.models) if config.models is not None else None,
                   config.weight, config.limits, source, created_at or time.time(),
                   config.objective.set_or_none(),
                   config.max_priority)


class KeyRing:
    """Keys by hash. Config keys are fixed; admin keys are replaced wholesale when the shared
    store is re-read (so a revocation elsewhere removes them here)."""

    def __init__(self, configured: list[ApiKey]) -> None:
        self.configured = {k.sha256: k for k in configured}
        self.admin: dict[str, ApiKey] = {}
        self._by_hash = dict(self.configured)

    def find(self, digest: str) -> ApiKey | None:
        key = self._by_hash.get(digest)
        # The dict found it by hash; the explicit constant-time compare keeps it honest.
        if key is None or not hmac.compare_digest(key.sha256, digest):
            return None
        return key

    def by_name(self, name: str) -> ApiKey | None:
        return next((k for k in self._by_hash.values() if k.name == name), None)

    def all(self) -> list[ApiKey]:
        return sorted(self._by_hash.values(), key=lambda k: k.name)

    def set_admin(self, keys: list[ApiKey]) -> None:
        """Replace the admin-created keys (a name or hash of a config key never shadows it)."""
        names = {k.name for k in self.configured.values()}
        self.admin = {k.sha256: k for k in keys
                      if k.name not in names and k.sha256 not in self.configured}
        self._by_hash = {**self.admin, **self.configured}

    def add_admin(self, key: ApiKey) -> None:
        self.set_admin([*self.admin.values(), key])

    def remove_admin(self, name: str) -> ApiKey | None:
        key = next((k for k in self.admin.values() if k.name == name), None)
        if key is not None:
            self.set_admin([k for k in self.admin.values() if k.name != name])
        return key
