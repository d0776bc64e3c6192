"""The autoscale signal's arithmetic (gateway/autoscale/signal.py), its smoothing, the
scale-down candidate and the demand window, without sockets."""

from __future__ import annotations

import math

import pytest

from gateway.autoscale.candidate import scale_down_candidates
from gateway.autoscale.demand import RecentDemand
from gateway.autoscale.signal import (Demand, OperatingPoint, Smoother, desired_replicas,
                                      operating_point, replicas, request_seconds,
                                      with_headroom)
from gateway.balance.ledger import InProcessLedger, ReplicaLoad
from gateway.fleet.replica import Replica
from gateway.flow.latency_model import LatencyModel, features
from gateway.kvcache.events import BlockStored, EventBatch
from gateway.kvcache.index import ReplicaBlocks


def fitted(ttft: tuple[float, float, float], tpot: tuple[float, float, float]) -> LatencyModel:
    """A latency model taught an engine whose TTFT and TPOT are exactly linear in the
    features (seconds: base, per thousand prompt tokens, per request in the batch)."""
    model = LatencyModel(forgetting=1.0)
    for n in range(1, 40):
        for prompt in (100, 1000, 3000):
            x = features(ReplicaLoad(in_flight=n - 1), prompt)
            model.observe(x, sum(w * v for w, v in zip(ttft, x)),
                          sum(w * v for w, v in zip(tpot, x)))
    return model


ENGINE = fitted((0.05, 0.2, 0.01), (0.010, 0.0, 0.002))  # TPOT 10 ms + 2 ms per request


def test_the_operating_point_is_the_most_requests_predicted_to_meet_the_objectives() -> None:
    # TPOT objective 50 ms: 0.010 + 0.002 n <= 0.050 -> n <= 20.
    point = operating_point(ENGINE, None, 50.0, 1000, limit=1024, target_in_flight=8)
    assert point.in_flight == 20
    assert point.tpot == pytest.approx(0.050, abs=1e-4)
    # TTFT 300 ms on a 1,000-token prompt: 0.05 + 0.2 + 0.01 n <= 0.3 -> n <= 5.
    assert operating_point(ENGINE, 300.0, 50.0, 1000, 1024, 8).in_flight == 5
    # The replica's own limit bounds it.
    assert operating_point(ENGINE, None, 50.0, 1000, limit=12, target_in_flight=8).in_flight == 12


def test_an_objective_no_load_meets_is_served_one_at_a_time() -> None:
    assert operating_point(ENGINE, 10.0, None, 1000, 1024, 8).in_flight == 1


def test_without_an_objective_or_a_fitted_model_the_target_holds() -> None:
    assert operating_point(None, 300.0, 50.0, 1000, 1024, 8) == OperatingPoint(8)
    unfitted = LatencyModel()  # fewer than min_samples
    assert operating_point(unfitted, 300.0, None, 1000, 1024, 8).in_flight == 8
    no_objective = operating_point(ENGINE, None, None, 1000, 1024, 8)
    assert no_objective.in_flight == 8 and no_objective.tpot is not None


def test_littles_law_at_the_operating_point_with_headroom() -> None:
    # 10 requests/s of 101 output tokens; at 20 a replica each takes TTFT + 100 x TPOT.
    point = OperatingPoint(20, ttft=0.5, tpot=0.05)
    demand = Demand(arrivals=10, prompt_tokens=1000, output_tokens=101)
    assert request_seconds(demand, point) == pytest.approx(5.5)
    # 55 requests at once at 20 a replica: 2.75 replicas' worth.
    assert desired_replicas(demand, point) == pytest.approx(55 / 20)
    assert replicas(desired_replicas(demand, point)) == 3


def test_headroom_sizes_replicas_below_the_operating_point_where_requests_are_quicker() -> None:
    point = operating_point(ENGINE, None, 50.0, 1000, 1024, 8)  # 20 a replica at most
    sized = with_headroom(ENGINE, point, 0.2, 1000)
    assert sized.in_flight == 16
    assert sized.tpot == pytest.approx(0.010 + 0.002 * 16, abs=1e-4)  # quicker than at 20
    demand = Demand(arrivals=10, prompt_tokens=1000, output_tokens=101)
    expected = 10 * (sized.ttft + 100 * sized.tpot) / 16
    assert desired_replicas(demand, sized) == pytest.approx(expected)
    # Not fitted: the target less the headroom, and the measured time.
    assert with_headroom(None, OperatingPoint(8), 0.2, 1000) == OperatingPoint(6)
    assert with_headroom(None, OperatingPoint(1), 0.5, 1000) == OperatingPoint(1)


def test_requests_running_or_waiting_count_when_more_than_the_arrivals_say() -> None:
    point = OperatingPoint(4)
    backlog = Demand(arrivals=0.1, seconds=1.0, in_flight=6, waiting=10)
    assert desired_replicas(backlog, point) == pytest.approx(16 / 4)


def test_a_trickle_or_a_held_request_wants_a_replica_and_nothing_wants_none() -> None:
    point = OperatingPoint(8)
    assert desired_replicas(Demand(), point) == 0
    held = desired_replicas(Demand(waiting=1), point)
    assert 0 < held and replicas(held) == 1
    # Arrivals with nothing measured yet (no request completed): still one.
    assert replicas(desired_replicas(Demand(arrivals=0.01), point)) == 1


def test_the_smoother_rises_at_once_and_falls_only_after_its_window() -> None:
    smoother = Smoother(scale_down_after=300)
    assert smoother.update(0, 2.0) == 2.0
    assert smoother.update(10, 5.0) == 5.0  # up at once
    assert smoother.update(20, 1.0) == 5.0  # down waits
    assert smoother.update(309, 1.5) == 5.0  # 5.0 at t=10 is still within 300 s
    assert smoother.update(311, 1.0) == 1.5  # then the highest since
    assert smoother.update(700, 0.0) == 0.0


def test_a_smoother_just_started_asks_for_what_is_there_until_it_has_seen_its_window() -> None:
    smoother = Smoother(scale_down_after=300, now=1000, start=3.0)
    assert smoother.update(1000, 0.0) == 3.0  # a restart is not a quiet spell
    assert smoother.update(1299, 0.5) == 3.0
    assert smoother.update(1301, 0.5) == 0.5
    assert smoother.update(1302, 4.0) == 4.0


def test_the_smoother_does_not_flap_on_a_noisy_signal() -> None:
    smoother = Smoother(scale_down_after=60)
    published = [smoother.update(t, 3.0 + (0.9 if t % 2 else -0.9)) for t in range(0, 600, 5)]
    assert {replicas(v) for v in published[1:]} == {4}  # the noise's top, held


def _replica(name: str, blocks: list[int] | None = None) -> Replica:
    replica = Replica(name, f"http://{name}", "vllm", "m", "default")
    if blocks is not None:
        replica.kv_cache = ReplicaBlocks()
        replica.kv_cache.apply(EventBatch(0.0, tuple(
            BlockStored((b,), None, (b, b + 1), 2) for b in blocks)))
    return replica


def test_the_candidate_owes_fewest_tokens_then_holds_least_cache_of_its_own() -> None:
    ledger = InProcessLedger()
    busy, shared, unique, drained = (_replica("busy", [1]), _replica("shared", [1, 2]),
                                     _replica("unique", [3, 4, 5]), _replica("drained"))
    ledger.lease("busy", 100, 50, 50)
    drained.draining = True
    pool = [busy, shared, unique, drained]
    # Three take requests; keep two: the one that owes nothing and whose blocks the others
    # hold too goes.
    assert scale_down_candidates(pool, ledger, keep=2) == [shared]
    assert scale_down_candidates(pool, ledger, keep=1) == [shared, unique]
    assert scale_down_candidates(pool, ledger, keep=3) == []


def test_demand_averages_the_window_and_forgets_what_left_it() -> None:
    demand = RecentDemand(window=10)
    for t in range(10):
        demand.arrived("m", 100 + t, now=100.0 + t)
    rate, prompt = demand.arrivals("m", now=109.5)
    assert rate == pytest.approx(1.0) and prompt == pytest.approx(104.5)
    demand.completed(("m", "default", "both"), 50, 2.0, now=105.0)
    demand.completed(("m", "default", "both"), 150, 4.0, now=106.0)
    assert demand.completions(("m", "default", "both"), now=109.0) == (100.0, 3.0)
    assert demand.arrivals("m", now=200.0) == (0.0, 0.0)
    assert demand.completions(("m", "default", "both"), now=200.0) == (0.0, 0.0)
    assert demand.arrivals("other", now=0.0) == (0.0, 0.0)
    assert not math.isnan(demand.arrivals("m", now=115.0)[1])
