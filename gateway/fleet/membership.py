"""The fleet: the models served and their replicas, which join and leave at run time (the
admin API, DNS discovery). A replica joins once its engine answered (window discovered,
health probed); one that leaves takes nothing new, finishes what it has, and is forgotten by
whatever remembered it (outlier records, a policy's affinity)."""

from __future__ import annotations

from typing import Awaitable, Callable

from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica
from gateway.fleet.role import Role


class Fleet:
    def __init__(self, models: dict[str, ServedModel]) -> None:
        self.models = models
        # Each engine once, whichever model entries list it (one Replica object).
        self.replicas = list({id(r): r for m in models.values() for r in m.replicas}.values())
        # Asks a new replica's engine for its window and health (set once probing can run).
        self.probe: Callable[[Replica], Awaitable[bool]] | None = None
        self.on_leave: list[Callable[[Replica], None]] = []

    def replica(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(name)

    async def add_replica(self, model: str, pool: str, url: str, engine: str,
                          name: str | None = None, max_model_len: int | None = None,
                          role: Role = Role.BOTH) -> Replica:
        """Put a new replica into rotation: probed first."""
        served = self.models[model]
        target = next((p for p in served.pools if p.name == pool), None)
        if target is None:
            raise KeyError(f"model {model!r} has no pool {pool!r}")
        replica = Replica(name=name or url.split("://", 1)[-1].rstrip("/"), url=url,
                          engine=engine, model=model, pool=pool, max_model_len=max_model_len,
                          role=role)
        if any(r.name == replica.name for r in self.replicas):
            raise ValueError(f"replica {replica.name!r} exists already")
        if self.probe is not None:
            replica.healthy = await self.probe(replica)
        target.replicas.append(replica)
        self.replicas.append(replica)
        return replica

    def remove_replica(self, name: str) -> Replica:
        """Take a replica out of rotation; its in-flight requests finish where they are."""
        replica = self.replica(name)
        replica.draining = True
        for model in self.models.values():  # every entry that lists it
            for pool in model.pools:
                if replica in pool.replicas:
                    pool.replicas.remove(replica)
        self.replicas.remove(replica)
        for forget in self.on_leave:
            forget(replica)
        return replica
