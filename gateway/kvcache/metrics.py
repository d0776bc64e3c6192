"""The KV event subscriptions, for Prometheus: events and what was dropped, replays, clears,
lag, the index's size, whether a replica routes on its events or on the approximate index,
and the prefix hit share the index predicted (beside the engine's own
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``). Published by the feeds'
loop once a second, never per event or per request."""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.kvcache.index import ReplicaBlocks
from gateway.kvcache.subscriber import FeedStats


class KvEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("llm_gateway_kv_events", "KV-cache events read from a replica's "
                              "engine, by type.", ("replica", "type"), registry=registry)
        self.dropped = Counter("llm_gateway_kv_events_dropped", "KV event messages or events "
                               "dropped unread (malformed, unknown type, unknown parent) or "
                               "missed (gap).", ("replica", "reason"), registry=registry)
        self.replays = Counter("llm_gateway_kv_event_replays", "Replays asked of a replica's "
                               "replay socket, by outcome (ok, incomplete, timeout, "
                               "unavailable).", ("replica", "outcome"), registry=registry)
        self.cleared = Counter("llm_gateway_kv_index_cleared", "Times a replica's index was "
                               "emptied, by cause (restart, gap, health_lost; the engine's "
                               "AllBlocksCleared counts as an event).", ("replica", "cause"),
                               registry=registry)
        self.lag = Gauge("llm_gateway_kv_event_lag_seconds", "Seconds between the engine "
                         "publishing its last batch and the gateway reading it (the two "
                         "clocks' offset included).", ("replica",),
                         multiprocess_mode="livemax", registry=registry)
        self.blocks = Gauge("llm_gateway_kv_index_blocks", "KV blocks the replica's engine "
                            "holds, as its events tell.", ("replica",),
                            multiprocess_mode="livemax", registry=registry)
        self.live = Gauge("llm_gateway_kv_events_live", "1 while the replica is routed on its "
                          "KV events; 0 while on the approximate prefix index (not connected, "
                          "or events stopped).", ("replica",), multiprocess_mode="livemin",
                          registry=registry)
        self.predicted = Counter("llm_gateway_kv_prefix_predicted_tokens", "Prompt tokens the "
                                 "index predicted cached on the replica each request was sent "
                                 "to.", ("replica",), registry=registry)
        self.prompted = Counter("llm_gateway_kv_prefix_prompt_tokens", "Prompt tokens of the "
                                "requests sent to the replica while it was routed on its "
                                "events.", ("replica",), registry=registry)
        self._seen: dict[tuple[str, str, str], float] = {}

    def publish(self, feeds: Iterable[tuple[str, ReplicaBlocks, FeedStats]],
                now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for replica, blocks, stats in feeds:
            for counter, name, counts in (
                    (self.events, "events", stats.events), (self.dropped, "dropped", stats.dropped),
                    (self.replays, "replays", stats.replays), (self.cleared, "cleared", stats.cleared),
                    (self.predicted, "predicted", {"": blocks.predicted_tokens}),
                    (self.prompted, "prompted", {"": blocks.queried_tokens})):
                for label, total in counts.items():
                    delta = total - self._seen.get((replica, name, label), 0)
                    if delta > 0:
                        child = counter.labels(replica, label) if label else counter.labels(replica)
                        child.inc(delta)
                        self._seen[replica, name, label] = total
            if stats.lag is not None:
                self.lag.labels(replica).set(stats.lag)
            self.blocks.labels(replica).set(blocks.size())
            self.live.labels(replica).set(1 if blocks.live(now) else 0)

    def forget(self, replica: str) -> None:
        """The replica left: its gauges go, and a new subscription counts from zero."""
        self._seen = {k: v for k, v in self._seen.items() if k[0] != replica}
        for gauge in (self.lag, self.blocks, self.live):
            try:
                gauge.remove(replica)
            except KeyError:
                pass
