"""The routing-policy interface and the factory that maps config names to policies.

A policy picks one replica among candidates that already fit the request (right API,
context window, healthy). Adding a policy is one new file and one line in ``POLICIES``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

from gateway.balance.ledger import LoadLedger
from gateway.fleet.replica import Replica

T = TypeVar("T")


@dataclass(slots=True)
class RequestCost:
    """What one request will cost a replica, in tokens."""

    prompt_tokens: int
    output_tokens: int


class Policy(Protocol):
    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica: ...


def pick_lowest(items: Sequence[T], key: Callable[[T], float], rng: random.Random) -> T:
    """The item with the lowest key; ties broken at random, never by list order."""
    best_key = min(key(item) for item in items)
    best = [item for item in items if key(item) == best_key]
    return best[0] if len(best) == 1 else rng.choice(best)


def _registry() -> dict[str, Callable[[], Policy]]:
    from gateway.balance.least_outstanding_tokens import LeastOutstandingTokens
    from gateway.balance.least_requests import LeastRequests
    from gateway.balance.round_robin import RoundRobin
    return {
        "least_outstanding_tokens": LeastOutstandingTokens,
        "least_requests": LeastRequests,
        "round_robin": RoundRobin,
    }


POLICIES = _registry()


def make_policy(name: str) -> Policy:
    return POLICIES[name]()
