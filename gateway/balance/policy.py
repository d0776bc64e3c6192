"""The routing-policy interface and the factory that maps config names to policies.

A policy picks one replica among candidates that already fit the request (right API,
context window, healthy). Adding a policy is one new file and one line in ``POLICIES``.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, TypeVar

from gateway.balance.ledger import LoadLedger
from gateway.fleet.replica import Replica

if TYPE_CHECKING:
    from gateway.config import SchedulingConfig

T = TypeVar("T")


@dataclass(slots=True)
class RequestCost:
    """What one request will cost a replica, in tokens."""

    prompt_tokens: int
    output_tokens: int
    # Chained hashes of the prompt's leading byte blocks (prefix_index.prompt_blocks): what a
    # replica that served the same prefix recently may still have in its prefix cache.
    prefix_blocks: tuple[int, ...] = ()
    session: str | None = None  # the client's session (x-session-id header or OpenAI `user`)


class Policy(Protocol):
    """Picks a replica. A policy that remembers replicas (affinity) may also define
    ``forget(replica_name)``, called when a replica leaves the fleet."""

    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica: ...


def pick_lowest(items: Sequence[T], key: Callable[[T], float], rng: random.Random) -> T:
    """The item with the lowest key; ties broken at random, never by list order."""
    keys = [key(item) for item in items]  # once each: keys may cost something
    best_key = min(keys)
    best = [item for item, k in zip(items, keys) if k == best_key]
    return best[0] if len(best) == 1 else rng.choice(best)


@functools.cache
def _registry() -> dict[str, Callable[[], Policy]]:
    from gateway.balance.least_expected_work import LeastExpectedWork
    from gateway.balance.least_outstanding_tokens import LeastOutstandingTokens
    from gateway.balance.least_requests import LeastRequests
    from gateway.balance.round_robin import RoundRobin
    return {
        "least_expected_work": LeastExpectedWork,
        "least_outstanding_tokens": LeastOutstandingTokens,
        "least_requests": LeastRequests,
        "round_robin": RoundRobin,
    }


def __getattr__(name: str) -> object:
    # POLICIES is built on first use, so a policy module can be imported first (it imports
    # this module, whose registry imports it back).
    if name == "POLICIES":
        return _registry()
    raise AttributeError(name)


def make_policy(name: str, scheduling: "SchedulingConfig | None" = None) -> Policy:
    """The named policy; the ones that have weights (``takes_scheduling``) get ``scheduling``."""
    factory = _registry()[name]
    if getattr(factory, "takes_scheduling", False):
        return factory(scheduling=scheduling)  # type: ignore[call-arg]
    return factory()
