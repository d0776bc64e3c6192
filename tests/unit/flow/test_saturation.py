"""When a replica is saturated (gateway/flow/saturation.py): engine signals kept current with
the ledger between scrapes, KV use, outstanding tokens; stale signals saturate nothing."""

from __future__ import annotations

from gateway.balance.ledger import ReplicaLoad
from gateway.config import FlowControlConfig
from gateway.engines import EngineSignals
from gateway.fleet.replica import Replica
from gateway.flow.saturation import Saturation


def replica(waiting: int, kv: float = 0.1, in_flight_then: int = 10, at: float = 100.0) -> Replica:
    r = Replica("r0", "http://r0", "vllm", "m", "default")
    r.signals = EngineSignals(running=8, waiting=waiting, kv_usage=kv, scraped_at=at,
                              ledger_in_flight=in_flight_then)
    return r


def test_the_engines_queue_kept_current_with_the_ledger() -> None:
    s = Saturation(FlowControlConfig(max_waiting=5), signals_max_age=3.0)
    assert s.saturated(replica(5), ReplicaLoad(0, 10), 100.5)
    # Three of those placed then have ended since: three waiting went in.
    assert not s.saturated(replica(5), ReplicaLoad(0, 7), 100.5)
    # Two placed since the scrape wait behind the three that were waiting.
    assert s.saturated(replica(3), ReplicaLoad(0, 12), 100.5)
    # No queue at the scrape: room of unknown size, not saturated until the next one.
    assert not s.saturated(replica(0), ReplicaLoad(0, 30), 100.5)


def test_kv_use_and_outstanding_tokens() -> None:
    s = Saturation(FlowControlConfig(max_kv_usage=0.9, max_outstanding_tokens=10_000), 3.0)
    assert s.saturated(replica(0, kv=0.92), ReplicaLoad(0, 10), 100.0)
    assert not s.saturated(replica(0, kv=0.5), ReplicaLoad(9_999, 10), 100.0)
    assert s.saturated(replica(0, kv=0.5), ReplicaLoad(10_000, 10), 100.0)


def test_stale_or_missing_signals_saturate_nothing() -> None:
    s = Saturation(FlowControlConfig(), signals_max_age=3.0)
    assert not s.saturated(replica(50, kv=1.0), ReplicaLoad(0, 10), 103.5)
    assert s.saturated(replica(50, kv=1.0), ReplicaLoad(0, 10), 102.9)
    assert not s.saturated(Replica("r", "http://r", "vllm", "m", "default"), ReplicaLoad(), 0.0)
