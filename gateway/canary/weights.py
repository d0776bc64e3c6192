"""Pool weights changed at run time (admin API, the canary guard), the same on every instance.

``set_weight`` applies at once on this instance. With Redis configured the new weight is
also written to the ``{p}canary:weights`` hash (at once, or at the next round if Redis is
away), and every instance adopts what the hash holds each ``interval`` seconds; a restarted
instance comes up with the fleet's weights. Last writer wins. Requests never touch Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from redis.asyncio import Redis

from gateway.fleet.model import Pool, ServedModel
from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger(__name__)

OnChange = Callable[[str, str, float], None]  # (model, pool, weight)


def _field(model: str, pool: str) -> str:
    return f"{model}\t{pool}"


class PoolWeights:
    def __init__(self, models: dict[str, ServedModel], on_change: OnChange | None = None) -> None:
        self.models = models
        self.on_change = on_change or (lambda model, pool, weight: None)
        self.redis: Redis | None = None
        self.keys: SharedKeys | None = None
        self.interval = 1.0
        self._pending: dict[tuple[str, str], float] = {}  # set here, not yet in Redis
        self._wake = asyncio.Event()
        for model in models.values():
            for pool in model.pools:
                self.on_change(model.name, pool.name, pool.weight)

    def share(self, redis: Redis, keys: SharedKeys, interval: float) -> None:
        """Share weights through Redis (``redis_url`` set)."""
        self.redis, self.keys, self.interval = redis, keys, interval

    def pool(self, model: str, pool: str) -> Pool:
        """The named pool (KeyError naming what is missing)."""
        served = self.models.get(model)
        if served is None:
            raise KeyError(f"no model named {model!r}")
        for candidate in served.pools:
            if candidate.name == pool:
                return candidate
        raise KeyError(f"model {model!r} has no pool {pool!r}")

    def set_weight(self, model: str, pool: str, weight: float) -> Pool:
        """Give a pool a new weight now (shared with the other instances when Redis is set).
        The canary guard sets a failing canary's weight to 0 through this."""
        if not weight >= 0 or weight == float("inf"):
            raise ValueError(f"weight must be a finite number >= 0, got {weight}")
        target = self.pool(model, pool)
        if target.shadow_of is not None:
            raise ValueError(f"pool {pool!r} shadows {target.shadow_of!r}: it takes no primary "
                             "traffic, so it has no weight")
        self._apply(model, target, weight)
        if self.redis is not None:
            self._pending[(model, pool)] = weight
            self._wake.set()
        return target

    def _apply(self, model: str, pool: Pool, weight: float) -> None:
        if pool.weight != weight:
            log.warning("canary: model %s pool %s weight %g -> %g", model, pool.name,
                        pool.weight, weight)
        pool.weight = weight
        self.on_change(model, pool.name, weight)

    async def sync(self) -> None:
        """One round: publish this instance's changes, adopt everyone's (raises on Redis
        errors; what was not published stays pending)."""
        if self.redis is None or self.keys is None:
            return
        key = self.keys.canary_weights
        if self._pending:
            pending = dict(self._pending)
            await self.redis.hset(key, mapping={_field(*k): repr(v) for k, v in pending.items()})
            for k, v in pending.items():
                if self._pending.get(k) == v:
                    del self._pending[k]
        shared = await self.redis.hgetall(key)
        for name, value in shared.items():
            model, _, pool = name.partition("\t")
            if (model, pool) in self._pending:
                continue  # changed here during the round trip: published next round
            try:
                target, weight = self.pool(model, pool), float(value)
            except (KeyError, ValueError):
                continue  # another configuration's pool, or junk: not ours to judge
            if weight >= 0 and target.weight != weight and target.shadow_of is None:
                self._apply(model, target, weight)

    async def run(self) -> None:
        """Sync every ``interval`` and at once after a local change (cancel to stop)."""
        failing = False
        while True:
            try:
                async with asyncio.timeout(max(self.interval, 0.1)):
                    await self.sync()
                if failing:
                    log.warning("canary: pool weights in sync with Redis again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - Redis away: keep the weights we have
                if not failing:
                    log.warning("canary: cannot sync pool weights with Redis (%s); keeping "
                                "this instance's", type(exc).__name__)
                failing = True
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
