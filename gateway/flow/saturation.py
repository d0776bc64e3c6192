"""When a replica is saturated: sending it more only queues them inside the engine, where no
priority holds, so they wait at the gateway instead (``gateway.dataplane.placement``).

A replica is saturated when any of these passes its threshold (``flow_control``):
- the engine's waiting requests, read from its fresh signals (``gateway.fleet.engine_signals``)
  and kept current between scrapes with the ledger: each request placed there since the
  scrape waits too, each one ended lets a waiting one in. (An engine that had no waiting
  requests at the scrape had room of unknown size: until the next scrape it counts as not
  saturated; the overshoot is at most one scrape interval's arrivals.)
- the engine's KV-cache use, as scraped;
- the ledger's outstanding tokens, or its prompt tokens not yet prefilled (exact, no scrape:
  a new prompt's first token waits for those), when a limit is set.
Stale or missing signals saturate nothing: the in-flight limit still holds.
"""

from __future__ import annotations

from gateway.balance.ledger import ReplicaLoad
from gateway.config import FlowControlConfig
from gateway.fleet.replica import Replica


class Saturation:
    def __init__(self, config: FlowControlConfig, signals_max_age: float) -> None:
        self.max_waiting = config.max_waiting
        self.max_kv_usage = config.max_kv_usage
        self.max_tokens = config.max_outstanding_tokens
        self.max_prefill = config.max_prefill_tokens
        self.signals_max_age = signals_max_age

    def saturated(self, replica: Replica, load: ReplicaLoad, now: float) -> bool:
        """``load``: the replica's ledger entry now; ``now``: ``time.monotonic()`` (the
        signals' clock)."""
        if self.max_tokens is not None and load.outstanding_tokens >= self.max_tokens:
            return True
        if self.max_prefill is not None and load.prefill_tokens >= self.max_prefill:
            return True
        signals = replica.signals
        if signals is None or not signals.fresh(now, self.signals_max_age):
            return False
        waiting = signals.waiting or 0
        if waiting:
            waiting += load.in_flight - signals.ledger_in_flight
        return waiting >= self.max_waiting or (signals.kv_usage or 0.0) >= self.max_kv_usage
