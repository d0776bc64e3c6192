"""The KV event metrics: counters follow the subscription's counts (only upwards), gauges
show the index, and a replica that leaves and comes back counts from zero."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.kvcache.events import BlockStored, EventBatch
from gateway.kvcache.index import ReplicaBlocks
from gateway.kvcache.metrics import KvEventMetrics
from gateway.kvcache.subscriber import FeedStats


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_counters_follow_the_feeds_and_gauges_show_the_index() -> None:
    registry = CollectorRegistry()
    metrics = KvEventMetrics(registry)
    blocks, stats = ReplicaBlocks(clock=lambda: 0.0), FeedStats()
    blocks.connected = True
    blocks.apply(EventBatch(0.0, (BlockStored((1, 2), None, (1, 2, 3, 4), 2),)))
    stats.events["BlockStored"] += 1
    stats.dropped["malformed batch"] += 2
    stats.lag = 0.25
    metrics.publish([("a", blocks, stats)], now=0.0)
    metrics.publish([("a", blocks, stats)], now=0.0)  # nothing new: nothing added
    assert value(registry, "llm_gateway_kv_events_total", replica="a", type="BlockStored") == 1
    assert value(registry, "llm_gateway_kv_events_dropped_total", replica="a",
                 reason="malformed batch") == 2
    assert value(registry, "llm_gateway_kv_index_blocks", replica="a") == 2
    assert value(registry, "llm_gateway_kv_events_live", replica="a") == 1
    assert value(registry, "llm_gateway_kv_event_lag_seconds", replica="a") == 0.25
    metrics.forget("a")
    assert value(registry, "llm_gateway_kv_index_blocks", replica="a") is None
    again = FeedStats()  # a new subscription to a replica of the same name
    again.events["BlockStored"] += 1
    metrics.publish([("a", ReplicaBlocks(clock=lambda: 0.0), again)], now=0.0)
    assert value(registry, "llm_gateway_kv_events_total", replica="a", type="BlockStored") == 2
    assert value(registry, "llm_gateway_kv_events_live", replica="a") == 0  # not connected
