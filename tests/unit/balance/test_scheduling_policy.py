"""least_expected_work, the default policy: live load, prefix affinity that yields to load,
engine signals only while fresh and only upwards, soft session stickiness, bounded memory."""

from __future__ import annotations

import random

import pytest

from gateway.balance import least_expected_work
from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import RequestCost, make_policy, policy_class
from gateway.balance.prefix_index import prompt_blocks
from gateway.config import SchedulingConfig, load_settings
from gateway.fleet.engine_signals import EngineSignals
from gateway.fleet.replica import Replica

LeastExpectedWork = least_expected_work.LeastExpectedWork


def replicas(n: int = 4) -> list[Replica]:
    return [Replica(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm", model="m",
                    pool="default") for i in range(n)]


def system_prompt(k: int) -> tuple[int, ...]:
    return prompt_blocks(f"system prompt {k}: be helpful. " * 300)  # ~9 KB, ~2k tokens


def policy(clock: list[float] | None = None, **weights: float) -> LeastExpectedWork:
    now = clock or [0.0]
    return LeastExpectedWork(random.Random(3), SchedulingConfig(**weights), clock=lambda: now[0])


def test_is_the_default_balancer_and_takes_its_weights_from_config() -> None:
    settings = load_settings(models=[{"name": "m", "replicas": [{"url": "http://h:1"}]}],
                             scheduling={"prefix_weight": 0.5, "session_tokens": 0})
    assert settings.balancer == "least_expected_work"
    chosen = make_policy(settings.balancer, settings.scheduling)
    assert isinstance(chosen, LeastExpectedWork) and chosen.weights.prefix_weight == 0.5
    with pytest.raises(Exception, match="prefix_wieght"):
        load_settings(models=[{"name": "m", "replicas": [{"url": "http://h:1"}]}],
                      scheduling={"prefix_wieght": 1})


def test_with_prefix_signals_and_sessions_off_it_is_least_outstanding_tokens() -> None:
    rng = random.Random(5)
    rs = replicas()
    ours, lot = policy(prefix_weight=0, signals_weight=0, session_tokens=0,
                       request_tokens=0), policy_class(
        "least_outstanding_tokens")(random.Random(3))
    ours.rng = random.Random(9)
    lot.rng = random.Random(9)
    ledger_a, ledger_b = InProcessLedger(), InProcessLedger()
    for i in range(300):
        cost = RequestCost(rng.randint(10, 6000), rng.randint(10, 500), system_prompt(i % 3),
                           f"s{i % 7}")
        a, b = ours.select(rs, cost, ledger_a), lot.select(rs, cost, ledger_b)
        assert a.name == b.name
        ledger_a.lease(a.name, cost.prompt_tokens, cost.output_tokens)
        ledger_b.lease(b.name, cost.prompt_tokens, cost.output_tokens)


def test_a_cached_prefix_wins_while_it_saves_more_than_the_extra_load() -> None:
    rs, ledger = replicas(2), InProcessLedger()
    p = policy()
    cost = RequestCost(2000, 100, system_prompt(1))
    bonus = p.weights.prefix_weight * 2000  # ~ what the cached prefix is worth there
    first = p.select(rs, cost, ledger)
    other = next(r for r in rs if r is not first)
    ledger.lease(first.name, 0, int(0.8 * bonus))  # busier, but by less than the bonus
    assert p.select(rs, cost, ledger) is first
    ledger.lease(first.name, 0, int(0.4 * bonus))  # now busier by more: the prefix no longer pays
    assert p.select(rs, cost, ledger) is other
    # ... and the other replica has learnt the prefix: it now wins on equal terms
    ledger.lease(other.name, 0, int(1.2 * bonus))
    assert p.select(rs, cost, ledger) in rs


def test_prefill_weight_prices_prompt_tokens_still_to_prefill() -> None:
    rs, ledger = replicas(2), InProcessLedger()
    ledger.lease("r0", 1000, 0)  # owes a 1,000-token prefill
    ledger.lease("r1", 0, 1200)  # owes 1,200 output tokens
    cost = RequestCost(100, 100)
    assert policy(session_tokens=0).select(rs, cost, ledger).name == "r0"
    assert policy(prefill_weight=1.5).select(rs, cost, ledger).name == "r1"


def test_a_popular_prefix_spreads_instead_of_starving_the_other_replicas() -> None:
    """One system prompt for every request, arriving faster than anything completes (the
    cache-aware router's failure: all of it on one replica)."""
    rs, ledger = replicas(), InProcessLedger()
    p = policy()
    counts = {r.name: 0 for r in rs}
    rng = random.Random(1)
    for _ in range(400):
        cost = RequestCost(2100, rng.randint(50, 200), system_prompt(0))
        chosen = p.select(rs, cost, ledger)
        counts[chosen.name] += 1
        ledger.lease(chosen.name, cost.prompt_tokens, cost.output_tokens)
    assert min(counts.values()) >= 400 / 4 / 2, counts


def test_distinct_prefixes_partition_across_replicas() -> None:
    """Sixteen prefixes under light load: each mostly stays where it was first placed."""
    rs, ledger = replicas(), InProcessLedger()
    p = policy()
    homes: dict[int, set[str]] = {k: set() for k in range(16)}
    rng = random.Random(2)
    for _ in range(800):
        k = rng.randrange(16)
        chosen = p.select(rs, RequestCost(2100, 100, system_prompt(k)), ledger)
        homes[k].add(chosen.name)
        lease = ledger.lease(chosen.name, 2100, 100)
        lease.close()  # light load: each finishes before the next arrives
    assert all(len(names) == 1 for names in homes.values()), homes
    assert len({next(iter(names)) for names in homes.values()}) == 4


def test_session_stickiness_is_soft() -> None:
    rs, ledger = replicas(2), InProcessLedger()
    p = policy(session_tokens=1000, request_tokens=0)  # (per-request work moves it sooner)
    cost = RequestCost(100, 100, session="alice")
    home = p.select(rs, cost, ledger)
    other = next(r for r in rs if r is not home)
    ledger.lease(home.name, 0, 900)
    assert p.select(rs, cost, ledger) is home  # 900 busier: still home
    ledger.lease(home.name, 0, 200)
    assert p.select(rs, cost, ledger) is other  # 1,100 busier: yields to load
    assert p.select(rs, RequestCost(100, 100, session="alice"), ledger) is other  # moved home


def test_fresh_engine_signals_count_work_the_ledger_does_not_know() -> None:
    clock = [100.0]
    rs, ledger = replicas(2), InProcessLedger()
    p = policy(clock, session_tokens=0)
    # r0's engine runs 20 requests another client sent it directly; the ledger placed none.
    rs[0].signals = EngineSignals(running=20, waiting=5, kv_usage=0.3, scraped_at=99.5,
                                  ledger_in_flight=0)
    rs[1].signals = EngineSignals(running=0, waiting=0, kv_usage=0.0, scraped_at=99.5)
    ledger.lease("r1", 500, 500)  # the ledger alone would pick r0
    assert p.select(rs, RequestCost(100, 100), ledger).name == "r1"
    clock[0] = 99.5 + 3.5  # older than signals_max_age (3) x signals_interval (1): ignored
    assert p.select(rs, RequestCost(100, 100), ledger).name == "r0"
    assert policy(clock, signals_weight=0).select(rs, RequestCost(100, 100), ledger).name == "r0"


def test_a_stale_or_low_engine_count_never_lowers_what_the_ledger_says() -> None:
    clock = [10.0]
    rs, ledger = replicas(2), InProcessLedger()
    for _ in range(10):
        ledger.lease("r0", 300, 300)
    # The engine has not seen the ledger's requests yet (scraped before they arrived).
    rs[0].signals = EngineSignals(running=0, waiting=0, kv_usage=0.0, scraped_at=10.0,
                                  ledger_in_flight=0)
    ledger.lease("r1", 300, 300)
    assert policy(clock).select(rs, RequestCost(100, 100), ledger).name == "r1"


def test_a_nearly_full_kv_cache_makes_a_replica_look_busier() -> None:
    clock = [5.0]
    rs, ledger = replicas(2), InProcessLedger()
    ledger.lease("r0", 0, 1000)
    ledger.lease("r1", 0, 1300)
    rs[0].signals = EngineSignals(running=1, waiting=0, kv_usage=0.999, scraped_at=5.0,
                                  ledger_in_flight=1)
    rs[1].signals = EngineSignals(running=1, waiting=0, kv_usage=0.5, scraped_at=5.0,
                                  ledger_in_flight=1)
    assert policy(clock).select(rs, RequestCost(10, 10), ledger).name == "r1"
    assert policy(clock, signals_weight=0).select(rs, RequestCost(10, 10), ledger).name == "r0"


def test_sessions_and_prefixes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(least_expected_work, "MAX_SESSIONS", 100)
    rs, ledger = replicas(), InProcessLedger()
    p = policy(prefix_cache_tokens=64 * 50)  # 50 blocks per replica
    for i in range(2000):
        p.select(rs, RequestCost(500, 10, prompt_blocks(f"prompt {i} " * 200), f"user{i}"),
                 ledger)
    assert len(p.sessions) == 100
    assert all(p.prefixes.size(r.name) <= 50 for r in rs)


def test_forget_drops_a_removed_replicas_prefixes_and_sessions() -> None:
    rs = replicas(2)
    policy = LeastExpectedWork()
    cost = RequestCost(100, 10, prefix_blocks=(1, 2, 3), session="s1")
    chosen = policy.select(rs, cost, InProcessLedger())
    assert policy.prefixes.matched_blocks(chosen.name, (1, 2, 3)) == 3
    assert policy.sessions["s1"] == chosen.name
    policy.forget(chosen.name)
    assert policy.prefixes.matched_blocks(chosen.name, (1, 2, 3)) == 0
    assert "s1" not in policy.sessions


# --- precise prefix affinity from the engines' KV events (gateway/kvcache) ---

def _events_fleet(capacity: int = 64):  # noqa: ANN202
    from gateway.kvcache.index import ReplicaBlocks
    fleet = replicas(2)
    for r in fleet:
        r.kv_cache = ReplicaBlocks(capacity=capacity, clock=lambda: 0.0)
        r.kv_cache.connected, r.kv_cache.block_size = True, 4
    return fleet


def _stored(replica: Replica, ids: list[int]) -> None:
    from gateway.kvcache.events import BlockStored, EventBatch
    hashes = tuple(hash((replica.name, i)) for i in range(len(ids) // 4))
    replica.kv_cache.apply(EventBatch(0.0, (BlockStored(hashes, None, tuple(ids), 4),)))


def test_with_live_events_the_engines_blocks_decide_not_what_was_sent_where() -> None:
    from gateway.kvcache.index import PromptKeys
    fleet, ledger = _events_fleet(capacity=256), InProcessLedger()
    ids = list(range(400))
    _stored(fleet[1], ids)  # another client's request left the prefix on r1
    chosen = policy().select(fleet, RequestCost(400, 16, (), None, PromptKeys(ids)), ledger)
    assert chosen.name == "r1"


def test_churn_sends_a_prefix_nobody_holds_where_the_cache_turns_over_least() -> None:
    from gateway.kvcache.index import PromptKeys
    fleet, ledger = _events_fleet(), InProcessLedger()
    _stored(fleet[0], list(range(1000, 1160)))  # r0 just stored 40 of its 64 blocks
    new = RequestCost(200, 16, (), None, PromptKeys(list(range(200))))
    picks = {policy(churn_weight=1.0).select(fleet, new, ledger).name for _ in range(20)}
    assert picks == {"r1"}
    off = SchedulingConfig(churn_weight=0.0)
    picks = set()
    for k in range(20):  # a new fleet each time: a pick notes its prompt as sent there
        fleet = _events_fleet()
        _stored(fleet[0], list(range(1000, 1160)))
        picks.add(LeastExpectedWork(random.Random(k), off, clock=lambda: 0.0).select(
            fleet, new, ledger).name)
    assert picks == {"r0", "r1"}  # off: a tie, broken at random
