"""The model names each engine serves, read from its ``GET /v1/models``, and the index from a
client's ``model`` to the model entry that serves it.

vLLM lists every name it answers to: the served names (``--served-model-name a b``), and
each LoRA adapter (``--lora-modules``, or loaded at run time) with ``parent`` set to its base
model. A name is routed only to the replicas that list it, unless the config names it (the
entry's name or an alias): those every replica of the entry serves. Names are read again
every ``health.names_interval`` seconds, so adapters loaded or unloaded at run time and
engines restarted with other names are followed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterator, Sequence

import aiohttp

from gateway.engines.base import positive_int
from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica

log = logging.getLogger(__name__)


def read_cards(replica: Replica, cards: Any) -> None:
    """Fill ``replica.served_names`` (and its window, unless configured) from a /v1/models
    answer. Something that is not a model list changes nothing."""
    data = cards.get("data") if isinstance(cards, dict) else None
    if not isinstance(data, list):
        return
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    replica.served_names = {c["id"]: c["parent"] if isinstance(c.get("parent"), str) else None
                            for c in cards}
    if replica.max_model_len is None:
        base = next((c for c in cards if c["id"] == replica.model), None) or next(
            (c for c in cards if replica.served_names[c["id"]] is None), cards[0] if cards else {})
        replica.max_model_len = positive_int(base.get("max_model_len"))


async def read_served_names(session: aiohttp.ClientSession, replica: Replica,
                            timeout: float) -> bool:
    """One read of the replica's /v1/models; False when it failed (nothing changes then)."""
    try:
        async with session.get(f"{replica.url}/v1/models",
                               timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                return False
            read_cards(replica, await response.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.info("could not read the model names of %s: %s", replica.name, exc)
        return False
    return True


class ServedNames:
    """Client model names -> the model entry serving them: configured names first (a dict
    lookup, the usual case), then the names replicas list (adapters, engine aliases)."""

    def __init__(self, models: dict[str, ServedModel]) -> None:
        self.models = models
        self.configured = {n: m for m in models.values()
                           for n in (*m.names, *m.load_adapters)}

    def resolve(self, name: str) -> ServedModel | None:
        model = self.configured.get(name)
        if model is not None:
            return model
        for model in self.models.values():
            if model.discover_names and any(name in r.served_names for r in model.replicas):
                return model
        return None

    def parent(self, name: str, model: ServedModel) -> str | None:
        """The base model of ``name`` when it is an adapter (a replica lists it with a
        ``parent``), else None."""
        if name in model.names:
            return None
        for replica in model.replicas:
            parent = replica.served_names.get(name)
            if parent is not None:
                return parent
        return None

    def listed(self) -> Iterator[tuple[str, ServedModel, str | None]]:
        """Every name served, once: (name, its model entry, its parent if an adapter)."""
        seen: set[str] = set()
        for model in self.models.values():
            for name in model.names:
                if name not in seen:
                    seen.add(name)
                    yield name, model, None
        for model in self.models.values():
            if not model.discover_names:
                continue
            for replica in model.replicas:
                for name, parent in replica.served_names.items():
                    if name not in seen:
                        seen.add(name)
                        yield name, model, parent


class NameRefresher:
    """Reads the /v1/models of every replica whose engine lists its names (TGI and llama.cpp
    answer one name whatever the request says) every ``interval`` seconds, forever."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]],
                 session: aiohttp.ClientSession, interval: float, timeout: float) -> None:
        self.replicas = replicas
        self.session = session
        self.interval = interval
        self.timeout = timeout

    async def refresh(self) -> None:
        await asyncio.gather(*(read_served_names(self.session, r, self.timeout)
                               for r in self.replicas() if r.profile.lists_models))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # never let one bad read end the loop
                log.exception("reading served model names failed")
