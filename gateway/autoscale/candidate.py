"""Which replica to remove when a pool needs fewer: the one whose loss costs least.

Cost, in order: the tokens it still owes (its streams must finish, or migrate, before it
goes), then the KV blocks only it holds (the prefixes the pool would prefill again), then its
name (a stable answer between scrapes)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from gateway.balance.ledger import LoadLedger
from gateway.fleet.replica import Replica


def removal_costs(replicas: Sequence[Replica], ledger: LoadLedger) -> list[tuple[int, int, str]]:
    """(outstanding tokens, blocks held by no other replica of ``replicas``, name) each."""
    holders: Counter[int] = Counter()
    for replica in replicas:
        if replica.kv_cache is not None:
            holders.update(replica.kv_cache.keys())
    return [(ledger.load(r.name).outstanding_tokens,
             sum(1 for key in r.kv_cache.keys() if holders[key] == 1)
             if r.kv_cache is not None else 0, r.name) for r in replicas]


def scale_down_candidates(replicas: Sequence[Replica], ledger: LoadLedger,
                          keep: int) -> list[Replica]:
    """The replicas to remove, cheapest first, so that ``keep`` remain (none when as many or
    fewer are there). Only replicas taking requests count: draining ones are going already."""
    available = [r for r in replicas if r.available]
    surplus = len(available) - keep
    if surplus <= 0:
        return []
    by_name = {r.name: r for r in available}
    return [by_name[name] for *_, name in sorted(removal_costs(available, ledger))[:surplus]]
