"""Where a replica's KV events come from: its own endpoints, else the port rule."""

from __future__ import annotations

from gateway.config import KvEventsConfig
from gateway.fleet.replica import Replica
from gateway.kvcache.feeds import KvEventFeeds, endpoints


def replica(url: str, engine: str = "vllm", **kw: str) -> Replica:
    return Replica(name=url, url=url, engine=engine, model="m", pool="default", **kw)


def test_the_port_rule_and_a_replicas_own_endpoints() -> None:
    rule = KvEventsConfig(enabled=True)
    assert endpoints(replica("http://10.0.0.5:8003"), rule) == ("tcp://10.0.0.5:9003",
                                                                 "tcp://10.0.0.5:10003")
    assert endpoints(replica("http://[fd00::1]:8000"), rule) == ("tcp://[fd00::1]:9000",
                                                                 "tcp://[fd00::1]:10000")
    pods = KvEventsConfig(enabled=True, port=5557, replay_port=5558)
    assert endpoints(replica("http://pod:8000"), pods) == ("tcp://pod:5557", "tcp://pod:5558")
    no_replay = KvEventsConfig(enabled=True, replay_port_offset=None)
    assert endpoints(replica("http://h:8000"), no_replay) == ("tcp://h:9000", None)
    own = replica("http://h:8000", kv_events="tcp://e:1", kv_replay="tcp://e:2")
    assert endpoints(own, rule) == ("tcp://e:1", "tcp://e:2")
    assert endpoints(replica("http://h:65000"), rule) is None  # past the last port


def test_replicas_without_events_are_asked_once() -> None:
    fleet = [replica("http://h:65000"), replica("http://t:8000", "tgi")]  # TGI publishes none
    feeds = KvEventFeeds(lambda: fleet, KvEventsConfig(enabled=True))
    feeds.reconcile()
    feeds.reconcile()
    assert feeds._without == {"http://h:65000", "http://t:8000"} and not list(feeds.feeds())
    feeds.context.term()

