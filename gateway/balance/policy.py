"""The routing-policy interface and the factory that maps config names to policies.

A policy picks one replica among candidates that already fit the request (right API,
context window, healthy). Adding a policy is one new file and one line in
``gateway.balance.POLICIES``.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from gateway.balance import POLICIES
from gateway.balance.ledger import LoadLedger
from gateway.fleet.replica import Replica
from gateway.kvcache.index import PromptKeys

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
    # The prompt's token ids keyed as the engines' KV events key blocks: set when a replica
    # that could serve it publishes its KV events (gateway/kvcache).
    prompt_keys: PromptKeys | None = None


class Policy:
    """Picks a replica (``select``). A policy that remembers replicas (affinity) forgets one
    that leaves the fleet (``forget``); one with weights says so (``takes_scheduling``: it is
    given the config's ``scheduling`` section)."""

    takes_scheduling = False

    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica:
        raise NotImplementedError

    def forget(self, replica: str) -> None:
        """The replica left the fleet."""


def pick_lowest(items: Sequence[T], key: Callable[[T], float], rng: random.Random) -> T:
    """The item with the lowest key; ties broken at random, never by list order."""
    keys = [key(item) for item in items]  # once each: keys may cost something
    best_key = min(keys)
    best = [item for item, k in zip(items, keys) if k == best_key]
    return best[0] if len(best) == 1 else rng.choice(best)


def policy_class(name: str) -> type[Policy]:
    module, _, cls = POLICIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_policy(name: str, scheduling: Any = None) -> Policy:
    """The named policy; the ones that have weights (``takes_scheduling``) get ``scheduling``
    (a ``gateway.config.SchedulingConfig``)."""
    factory = policy_class(name)
    if factory.takes_scheduling:
        return factory(scheduling=scheduling)
    return factory()
