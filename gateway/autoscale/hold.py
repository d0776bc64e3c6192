"""Scale from zero: a request for a model with no replica registered (none in the config, DNS
or Kubernetes, or all removed through the admin API) waits here until one is available, in
priority order, instead of a refusal; the autoscale signal counts it at once, so an
autoscaler starts one. A model whose replicas exist but are all down is an outage, not a
scale-up: it is not held (placement answers as ever)."""

from __future__ import annotations

import asyncio
import itertools

from gateway.autoscale.config import ScaleFromZeroConfig
from gateway.fleet.model import ServedModel
from gateway.protocol.errors import ScaledToZero

_RECHECK_SECONDS = 0.1  # how often the held look for a replica (one that joined, or came up)


class _Held:
    __slots__ = ("priority", "order", "released")

    def __init__(self, priority: int, order: int, released: asyncio.Future) -> None:
        self.priority, self.order, self.released = priority, order, released


class ScaleFromZero:
    def __init__(self, config: ScaleFromZeroConfig) -> None:
        self.config = config
        self._held: dict[str, list[_Held]] = {}  # per model
        self._watchers: dict[str, asyncio.Task] = {}  # per model with requests held
        self._order = itertools.count()

    def held(self, model: str) -> int:
        return len(self._held.get(model, ()))

    def held_by_model(self) -> dict[str, int]:
        return {model: len(held) for model, held in self._held.items()}

    def holds(self, model: ServedModel) -> bool:
        """``model`` has no replica registered: its requests wait (``wait_for_replica``).
        Asked of every request, so not a coroutine."""
        return self.config.enabled and not any(pool.replicas for pool in model.pools)

    async def wait_for_replica(self, model: ServedModel, priority: int) -> None:
        """Return at once while ``model`` has a replica registered; else wait until one is
        available (raise ScaledToZero past the timeout)."""
        if not self.holds(model):
            return
        held = self._held.setdefault(model.name, [])
        if len(held) >= self.config.max_held:
            raise ScaledToZero(f"model `{model.name}` has no replica (scaled to zero) and "
                               f"{len(held)} requests already wait for one",
                               self.config.retry_after)
        me = _Held(priority, next(self._order), asyncio.get_running_loop().create_future())
        held.append(me)
        if model.name not in self._watchers:
            self._watchers[model.name] = asyncio.create_task(self._watch(model),
                                                             name="scale-from-zero")
        try:
            await asyncio.wait_for(asyncio.shield(me.released), self.config.timeout)
        except TimeoutError:
            raise ScaledToZero(f"model `{model.name}` has no replica (scaled to zero) and "
                               f"none became available within "
                               f"{self.config.timeout:g}s", self.config.retry_after) from None
        finally:
            if me in held:  # timed out, or the client left
                held.remove(me)

    async def _watch(self, model: ServedModel) -> None:
        """While requests are held: once a replica is available, release them all, highest
        priority first (futures resolved in that order resume in that order)."""
        try:
            while self._held.get(model.name):
                if any(r.available for r in model.replicas):
                    held = self._held.pop(model.name)
                    for waiter in sorted(held, key=lambda h: (-h.priority, h.order)):
                        waiter.released.set_result(None)
                    held.clear()
                    return
                await asyncio.sleep(_RECHECK_SECONDS)
        finally:
            self._watchers.pop(model.name, None)
            if not self._held.get(model.name, True):
                self._held.pop(model.name, None)

    async def stop(self) -> None:
        for task in list(self._watchers.values()):
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
