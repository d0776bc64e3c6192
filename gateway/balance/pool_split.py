"""Which pool of a model a request goes to: forced, sticky by key, or weighted per request.

Every request of a model with several pools passes here (weighted pools, blue/green, a
canary's share): the split is balancing across pools, before a replica is picked in one.

A request that carries a key (``x-session-id``, else the OpenAI ``user`` field, else the API
key's name) always lands in the same pool: weighted rendezvous hashing (Schindelhauer &
Schomaker) scores every pool ``-weight / ln(u)``, ``u`` a uniform hash of (key, pool), and
the highest score wins. Each pool gets its weight's share of the keys, every instance picks
the same pool with no shared table, and a weight change moves only the keys it has to: a
key leaves a pool only for one whose weight grew relative to it (90/10 -> 80/20 moves keys
from stable into canary, none the other way). If the key's pool has no eligible replica,
the key goes to its next pool by score; a pool that is only full is waited for (queued), not
left. Without a key the draw is random by weight.

Pools that shadow another (``shadow_of``) take no primary traffic, unless a tester forces
one with ``x-gateway-pool``.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Sequence

from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.errors import InvalidRequest
from gateway.protocol.request import MAX_SESSION_CHARS, Context, GenerationRequest

POOL_HEADER = b"x-gateway-pool"
MAX_POOL_CHARS = 200


class UnknownPool(InvalidRequest):
    """``x-gateway-pool`` names no pool of the model: a 400 on both protocols."""

    def __init__(self, pool: str, model: ServedModel) -> None:
        names = ", ".join(p.name for p in model.pools)
        super().__init__(f"x-gateway-pool: model `{model.name}` has no pool named "
                         f"`{pool[:MAX_POOL_CHARS]}` (its pools: {names})", param="x-gateway-pool")

    def tgi_status(self) -> int:
        return 400


def sticky_key(request: GenerationRequest, context: Context) -> str | None:
    """The key that keeps a client in one pool: session, else OpenAI ``user``, else API key."""
    if context.session:
        return context.session
    user = request.body.get("user")
    if isinstance(user, str) and 0 < len(user) <= MAX_SESSION_CHARS:
        return user
    if context.caller is not None:
        return context.caller.name
    return None


def _unit(key: str, pool: str) -> float:
    """A uniform draw in (0, 1) fixed by (key, pool), the same in every process."""
    digest = hashlib.blake2b(f"{pool}\x00{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / (2.0 ** 64 + 2)


def rendezvous(pools: Sequence[Pool], key: str) -> Pool | None:
    """The key's pool among ``pools`` by weighted rendezvous hashing (None if all weigh 0)."""
    best, best_score = None, 0.0
    for pool in pools:
        if pool.weight <= 0:
            continue
        score = -pool.weight / math.log(_unit(key, pool.name))
        if score > best_score:
            best, best_score = pool, score
    return best


def is_shadow(pool: Pool) -> bool:
    return pool.shadow_of is not None


class PoolSplit:
    """Chooses the pool; ``allow_header`` lets ``x-gateway-pool`` force one."""

    def __init__(self, allow_header: bool = True, rng: random.Random | None = None) -> None:
        self.allow_header = allow_header
        self.rng = rng or random.Random()

    def candidates(self, model: ServedModel, request: GenerationRequest, context: Context,
                   replicas: list[Replica]) -> list[Replica]:
        """The replicas a request may go to: its forced pool's, else those of the pools that
        take primary traffic (raises UnknownPool)."""
        forced = context.pool if self.allow_header or request.shadow else None
        if forced is not None:
            pool = next((p for p in model.pools if p.name == forced), None)
            if pool is None:
                raise UnknownPool(forced, model)
            return [r for r in replicas if r.pool == pool.name]
        if not any(is_shadow(p) for p in model.pools):
            return replicas
        shadows = {p.name for p in model.pools if is_shadow(p)}
        return [r for r in replicas if r.pool not in shadows]

    def own_pool(self, pools: Sequence[Pool], available: list[Replica],
                 key: str) -> list[Replica]:
        """The replicas of ``available`` in the key's pool (its next by score when its own
        has none available). A full pool is not a reason to move: the key waits for a slot
        there, so a saturated fleet does not mix a session's answers across engines."""
        pool = self.pick(pools, {id(r) for r in available}, key)
        return [r for r in available if r.pool == pool.name] if pool is not None else available

    def pick(self, pools: Sequence[Pool], eligible: set[int], key: str | None) -> Pool | None:
        """A pool with an eligible replica: the key's (or its next by score), else by weight."""
        usable = [p for p in pools if any(id(r) in eligible for r in p.replicas)]
        if len(usable) <= 1:
            return usable[0] if usable else None
        if key is not None:
            chosen = rendezvous(usable, key)
            if chosen is not None:
                return chosen
        weights = [p.weight for p in usable]
        if sum(weights) <= 0:
            return self.rng.choice(usable)
        return self.rng.choices(usable, weights)[0]
