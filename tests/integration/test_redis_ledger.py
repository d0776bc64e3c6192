"""The shared ledger: own load exact and local, peers' load from Redis, never negative;
the replica state (ejection, draining) merged across instances; the sync failing open."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.balance.ledger import ReplicaLoad
from gateway.balance.redis_ledger import RedisLedger, parse_load
from gateway.config import ConfigError, load_settings
from gateway.fleet.replica import Replica
from gateway.fleet.shared_replica_state import SharedReplicaState
from gateway.metrics import SharedStateMetrics
from gateway.shared.redis_keys import SharedKeys
from gateway.shared.sync import SharedStateSync, connect, redacted
from redis_support import SHARED_URL, delete_prefix, private_redis, unique_prefix
from support import wait_until_async

REPLICAS = ["a", "b", "c"]


def ledger(instance: str = "me", prefix: str = "t:", peer_ttl: float = 1.0) -> RedisLedger:
    return RedisLedger(SharedKeys(prefix), instance, peer_ttl)


def loads(ledger: RedisLedger, replicas: list[str] = REPLICAS) -> dict[str, tuple[int, int]]:
    return {r: (ledger.load(r).outstanding_tokens, ledger.load(r).in_flight) for r in replicas}


# --- pure logic, no Redis ---

def test_view_is_own_exact_plus_peers_replaced_wholesale() -> None:
    ours = ledger()
    lease = ours.lease("a", 100, 20)
    ours.set_peers({"p1": {"a": ReplicaLoad(50, 1, 40)}, "p2": {"a": ReplicaLoad(7, 1),
                                                               "b": ReplicaLoad(3, 1)}})
    assert loads(ours) == {"a": (177, 3), "b": (3, 1), "c": (0, 0)}
    assert ours.load("a").prefill_tokens == 140
    assert ours.own_load("a") == ReplicaLoad(120, 1, 100)
    lease.first_token()  # own changes apply at once, peers' part unchanged
    assert loads(ours)["a"] == (77, 3)
    assert ours.load("a").prefill_tokens == 40
    ours.set_peers({"p1": {"a": ReplicaLoad(5, 1)}})  # p2 gone, p1 replaced, not added
    assert loads(ours) == {"a": (25, 2), "b": (0, 0), "c": (0, 0)}
    lease.close()
    ours.stale()
    assert loads(ours) == {r: (0, 0) for r in REPLICAS}
    assert ours.snapshot() == {r: ReplicaLoad(0, 0) for r in ("a", "b", "c")}


def test_parse_load_accepts_only_non_negative_integers() -> None:
    assert parse_load("12 3 5") == ReplicaLoad(12, 3, 5)
    assert parse_load("12 3") == ReplicaLoad(12, 3, 0)  # a peer still on the older format
    for bad in ("", "12", "-1 0", "1 -1", "1.5 2", "a b", "1 2 -3", "1 2 3 4"):
        assert parse_load(bad) is None


peer_loads = st.dictionaries(st.sampled_from(["p1", "p2", "p3"]),
                             st.dictionaries(st.sampled_from(REPLICAS),
                                             st.builds(ReplicaLoad, st.integers(0, 10**6),
                                                       st.integers(0, 100))))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(REPLICAS), st.integers(0, 5000), st.integers(0, 500)),
                min_size=1, max_size=30),
       st.lists(peer_loads, min_size=1, max_size=10), st.randoms(use_true_random=False))
def test_request_lives_and_peer_rounds_interleaved(lives, rounds, rnd: random.Random) -> None:
    """Whatever peers publish and whenever, own load is exact, the view is own + peers and
    nothing is ever negative; at the end own is zero and the view is exactly the peers'."""
    ours = ledger()
    leases = [ours.lease(r, p, o) for r, p, o in lives]
    steps = [(lease, step) for lease in leases for step in ("first", "gen", "close")]
    steps += [(None, peers) for peers in rounds]
    pending = list(steps)
    latest: dict = {}
    while pending:
        lease, step = pending.pop(rnd.randrange(len(pending)))
        if lease is None:
            ours.set_peers(step)
            latest = step
        elif step == "first":
            lease.first_token()
        elif step == "gen":
            lease.generated(rnd.randrange(0, 600))
        else:
            lease.close()
        for r in REPLICAS:
            peers = [p[r] for p in latest.values() if r in p]
            own = ours.own_load(r)
            assert own.outstanding_tokens >= 0 and own.in_flight >= 0
            assert ours.load(r).outstanding_tokens == (
                own.outstanding_tokens + sum(p.outstanding_tokens for p in peers))
            assert ours.load(r).in_flight == own.in_flight + sum(p.in_flight for p in peers)
    for r in REPLICAS:
        assert ours.own_load(r) == ReplicaLoad(0, 0)
    ours.set_peers({})
    assert loads(ours) == {r: (0, 0) for r in REPLICAS}


def test_redis_settings_and_their_timing_check(monkeypatch: pytest.MonkeyPatch) -> None:
    models = [{"name": "m", "replicas": [{"url": "http://127.0.0.1:1"}]}]
    monkeypatch.setenv("GATEWAY_REDIS_KEY_PREFIX", "{team-a}:")
    config = load_settings(models=models, redis_url="redis://127.0.0.1:6379/3")
    assert (config.redis_key_prefix, config.redis_sync_interval, config.redis_peer_ttl,
            config.redis_timeout) == ("{team-a}:", 0.1, 1.0, 0.5)
    with pytest.raises(ConfigError, match="redis_peer_ttl must be at least 3 x"):
        load_settings(models=models, redis_sync_interval=0.5, redis_peer_ttl=1.0)
    with pytest.raises(ConfigError, match="redis_sync_interval"):
        load_settings(models=models, redis_sync_interval=0)


def test_log_urls_carry_no_credentials() -> None:
    assert redacted("redis://user:secret@cache.internal:6380/2") == "redis://cache.internal:6380/2"
    assert redacted("redis://cache.internal") == "redis://cache.internal:6379"


# --- against the real Redis (the shared server, a prefix of our own) ---

@pytest.fixture()
async def shared() -> AsyncIterator[tuple[Redis, str]]:
    prefix = unique_prefix()
    client = connect(SHARED_URL, 2.0)
    try:
        yield client, prefix
    finally:
        await client.aclose()
        delete_prefix(SHARED_URL, prefix)


async def test_two_ledgers_see_each_other_through_redis(shared) -> None:
    redis, prefix = shared
    a, b = ledger("A", prefix), ledger("B", prefix)
    lease = a.lease("a", 1000, 100)
    await a.sync(redis)
    await b.sync(redis)
    assert loads(b)["a"] == (1100, 1)
    assert b.own_load("a") == ReplicaLoad(0, 0)
    assert set(b.peers) == {"A"}
    assert await redis.hgetall(f"{prefix}load:A") == {"a": "1100 1 1000"}
    assert b.load("a").prefill_tokens == 1000
    b_lease = b.lease("b", 10, 5)
    await b.sync(redis)
    await a.sync(redis)
    assert loads(a) == {"a": (1100, 1), "b": (15, 1), "c": (0, 0)}
    lease.close()
    b_lease.close()
    await a.sync(redis)
    await b.sync(redis)
    await a.sync(redis)
    assert loads(a) == loads(b) == {r: (0, 0) for r in REPLICAS}
    # Idle instances publish nothing: no load key, only heartbeats.
    assert not await redis.exists(f"{prefix}load:A", f"{prefix}load:B")
    assert set(await redis.zrange(f"{prefix}instances", 0, -1)) == {"A", "B"}


async def test_crashed_peer_stops_counting_after_its_ttl(shared) -> None:
    redis, prefix = shared
    ttl = 0.3
    crashed, survivor = ledger("crashed", prefix, ttl), ledger("survivor", prefix, ttl)
    crashed.lease("a", 500, 0)  # never released: the process "dies" holding it
    await crashed.sync(redis)
    await survivor.sync(redis)
    assert loads(survivor)["a"] == (500, 1)
    seen_at = time.monotonic()

    async def expired() -> bool:  # the survivor keeps syncing, the crashed one not
        if loads(survivor)["a"] == (0, 0):
            return True
        await asyncio.sleep(0.05)
        await survivor.sync(redis)
        return loads(survivor)["a"] == (0, 0)

    await wait_until_async(expired, 5, "the phantom load to expire", every=0)
    assert time.monotonic() - seen_at >= ttl * 0.5  # it did count until its heartbeat lapsed
    assert not await redis.exists(f"{prefix}load:crashed")
    assert await redis.zrange(f"{prefix}instances", 0, -1) == ["survivor"]


async def test_withdraw_leaves_the_view_at_once(shared) -> None:
    redis, prefix = shared
    leaving, staying = ledger("leaving", prefix), ledger("staying", prefix)
    leaving.lease("c", 40, 2)
    await leaving.sync(redis)
    await staying.sync(redis)
    assert loads(staying)["c"] == (42, 1)
    await leaving.withdraw(redis)
    await staying.sync(redis)
    assert loads(staying)["c"] == (0, 0) and staying.peers == {}


def replicas() -> list[Replica]:
    return [Replica(name=n, url=f"http://127.0.0.1:{9000 + i}", engine="vllm", model="m",
                    pool="default") for i, n in enumerate(REPLICAS)]


async def test_replica_state_ejection_and_drain_are_shared(shared) -> None:
    redis, prefix = shared
    keys = SharedKeys(prefix)
    fleet_a, fleet_b = replicas(), replicas()
    a, b = SharedReplicaState(fleet_a, keys), SharedReplicaState(fleet_b, keys)
    await a.sync(redis)
    await b.sync(redis)
    assert not any(r.draining or r.ejected for r in fleet_a + fleet_b)
    # A drains "a" and ejects "b"; B ejects "b" for longer: the later end wins everywhere.
    now = time.time()
    fleet_a[0].draining = True
    fleet_a[1].ejected_until = now + 30
    fleet_b[1].ejected_until = now + 60
    await a.sync(redis)
    await b.sync(redis)
    await a.sync(redis)
    for fleet in (fleet_a, fleet_b):
        assert [r.state for r in fleet] == ["draining", "ejected", "healthy"]
        assert fleet[1].ejected_until == now + 60
    # B undrains "a" and lifts the ejection of "b" early: lowering is published as is.
    fleet_b[0].draining = False
    fleet_b[1].ejected_until = 0.0
    await b.sync(redis)
    await a.sync(redis)
    assert [r.state for r in fleet_a] == ["healthy"] * 3
    # A drain survives a Redis that lost everything: its holders re-seed it, and an
    # instance holding only defaults never overwrites it.
    fleet_a[2].draining = True
    await a.sync(redis)
    await b.sync(redis)
    assert fleet_b[2].draining
    delete_prefix(SHARED_URL, prefix)
    newcomer = replicas()
    c = SharedReplicaState(newcomer, keys)
    await c.sync(redis)  # first after the loss, with defaults: writes nothing
    await a.sync(redis)
    await c.sync(redis)
    assert [r.draining for r in newcomer] == [False, False, True]
    assert await redis.hgetall(f"{prefix}replica:draining") == {"c": "1"}


# --- the sync task against a Redis of our own that we kill, freeze and restart ---

def sync_task(url: str, prefix: str, instance: str, fleet: list[Replica],
              registry: CollectorRegistry) -> SharedStateSync:
    keys = SharedKeys(prefix)
    return SharedStateSync(connect(url, 0.3), RedisLedger(keys, instance, peer_ttl=0.6),
                           SharedReplicaState(fleet, keys), interval=0.1, timeout=0.3,
                           metrics=SharedStateMetrics(registry))


async def test_sync_fails_open_and_converges_after_redis_restarts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.shared.sync")
    with private_redis(tmp_path) as server:
        registry = CollectorRegistry()
        a = sync_task(server.url, "x:", "A", replicas(), CollectorRegistry())
        b = sync_task(server.url, "x:", "B", replicas(), registry)
        try:
            lease = a.ledger.lease("a", 300, 30)
            assert await a.round() and await b.round()
            assert loads(b.ledger)["a"] == (330, 1)
            assert registry.get_sample_value("llm_gateway_shared_state_up") == 1
            assert registry.get_sample_value("llm_gateway_shared_view_outstanding_tokens",
                                             {"replica": "a"}) == 330

            server.kill()
            started = time.monotonic()
            failures = 0
            # Down: rounds fail fast; peers' load is kept for the TTL, then dropped.
            async def dropped() -> bool:
                nonlocal failures
                if loads(b.ledger)["a"] == (0, 0):
                    return True
                assert not await asyncio.wait_for(b.round(), 5)
                failures += 1
                return False

            await wait_until_async(dropped, 5, "the peers' load dropped", every=0.1)
            assert time.monotonic() - started >= 0.6
            own = b.ledger.lease("b", 10, 0)  # requests go on, on own load
            assert loads(b.ledger)["b"] == (10, 1)
            assert registry.get_sample_value("llm_gateway_shared_state_up") == 0
            assert registry.get_sample_value(
                "llm_gateway_shared_state_sync_failures_total") == failures
            down_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(down_logs) == 1  # once per transition, not per round

            server.start()  # empty: no persistence
            assert await a.round() and await b.round()
            assert loads(b.ledger)["a"] == (330, 1)  # converged: A re-published
            await a.round()
            assert loads(a.ledger)["b"] == (10, 1)
            assert registry.get_sample_value("llm_gateway_shared_state_up") == 1
            # Both at start, and B once back (A had no round while Redis was down).
            assert len([r for r in caplog.records if "in sync" in r.getMessage()]) == 3
            lease.close()
            own.close()
            assert await a.round() and await b.round() and await a.round()
            assert loads(a.ledger) == loads(b.ledger) == {r: (0, 0) for r in REPLICAS}
        finally:
            await a.close()
            await b.close()


async def test_frozen_redis_fails_the_round_within_its_timeout(tmp_path: Path) -> None:
    """A Redis that accepts connections but never answers (SIGSTOP) must not hang a round."""
    with private_redis(tmp_path) as server:
        task = sync_task(server.url, "x:", "A", replicas(), CollectorRegistry())
        try:
            assert await task.round()
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                assert not await asyncio.wait_for(task.round(), 5)
                assert task.up is False
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert await task.round() and task.up
        finally:
            await task.close()


async def test_placed_requests_are_announced_without_waiting_for_the_interval(shared) -> None:
    """With a 5 s interval, only the pub/sub announcement can make a peer see a new request
    (and its end) within 2 s; cancelling the tasks stops them (no sync through shutdown)."""
    redis, prefix = shared
    keys = SharedKeys(prefix)

    def task(instance: str) -> SharedStateSync:
        return SharedStateSync(connect(SHARED_URL, 0.5), RedisLedger(keys, instance, 15.0),
                               SharedReplicaState([], keys), interval=5.0, timeout=0.5)

    a, b = task("A"), task("B")
    runs = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        async def both_ready() -> bool:  # subscribed and through their first round
            [(_, subscribers)] = await redis.pubsub_numsub(keys.load_events)
            return a.up is True and b.up is True and subscribers == 2

        await wait_until_async(both_ready, 5, "both instances subscribed and in sync")
        lease = a.ledger.lease("a", 200, 20)
        started = time.monotonic()
        await wait_until_async(lambda: loads(b.ledger)["a"] == (220, 1), 2, "announced",
                               every=0.005)
        lease.close()
        await wait_until_async(lambda: loads(b.ledger)["a"] == (0, 0),
                               4 - (time.monotonic() - started), "end announced", every=0.005)
    finally:
        for run in runs:
            run.cancel()
        done, _ = await asyncio.wait(runs, timeout=5)
        assert len(done) == 2
        await a.close()
        await b.close()
