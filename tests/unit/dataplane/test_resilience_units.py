"""Outlier ejection, the retry budget and the router's bounded queue, without sockets."""

from __future__ import annotations

import asyncio

import pytest

from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import make_policy
from gateway.config import BackpressureConfig, OutlierConfig
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.outlier import OutlierDetector
from gateway.fleet.replica import Replica
from gateway.protocol.errors import Api, NoReplicaAvailable, Overloaded
from gateway.protocol.request import GenerationRequest
from gateway.dataplane.retry_budget import RetryBudget
from routing import Routing
from support import wait_until_async


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replicas(n: int) -> list[Replica]:
    return [Replica(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm", model="m",
                    pool="default") for i in range(n)]


def test_outlier_ejects_after_consecutive_failures_with_growing_backoff(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr("gateway.fleet.replica.time.time", clock)
    rs = replicas(4)
    detector = OutlierDetector(OutlierConfig(consecutive_failures=2, base_ejection=5,
                                             max_ejection=12), lambda r: rs, clock)
    r0 = rs[0]
    detector.failure(r0)
    detector.success(r0)  # a success in between resets the streak
    detector.failure(r0)
    assert not r0.ejected
    detector.failure(r0)
    assert r0.ejected and r0.state == "ejected" and not r0.available
    assert r0.ejected_until == clock.now + 5
    clock.now += 5.1
    assert r0.available  # back after its time out
    detector.failure(r0)
    detector.failure(r0)
    assert r0.ejected_until == pytest.approx(clock.now + 10)  # doubled
    clock.now += 10.1
    detector.failure(r0)
    detector.failure(r0)
    assert r0.ejected_until == pytest.approx(clock.now + 12)  # capped
    clock.now += 12.1
    detector.success(r0)
    detector.failure(r0)
    detector.failure(r0)
    assert r0.ejected_until == pytest.approx(clock.now + 5)  # a success reset the back-off


def test_outlier_never_ejects_more_than_the_cap(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr("gateway.fleet.replica.time.time", clock)
    rs = replicas(4)
    detector = OutlierDetector(OutlierConfig(consecutive_failures=1, max_ejected_percent=50),
                               lambda r: rs, clock)
    for replica in rs:
        detector.failure(replica)
    assert [r.ejected for r in rs] == [True, True, False, False]


def test_retry_budget_caps_retries_at_a_share_of_requests() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.2, min_per_second=0.5, clock=clock)  # floor: 5 per window
    for _ in range(100):
        budget.request()
    allowed = sum(budget.try_spend() for _ in range(1000))
    assert allowed == 5 + 20
    clock.now += 11  # the window slid past all of it
    assert budget.try_spend()


def _model(rs: list[Replica]) -> ServedModel:
    return ServedModel("m", [Pool("default", 100, rs)], None, 4096, 16)


def _router(rs: list[Replica], **backpressure) -> Routing:
    return Routing({"m": _model(rs)}, make_policy("least_outstanding_tokens"),
                  InProcessLedger(), BackpressureConfig(**backpressure))


def _request() -> GenerationRequest:
    from gateway.protocol.openai import parse_completion
    return parse_completion(b'{"model": "m", "prompt": "hi", "max_tokens": 8}')


async def test_router_queues_at_the_in_flight_limit_and_wakes_in_order() -> None:
    rs = replicas(2)
    router = _router(rs, max_in_flight_per_replica=1, queue_size=2, queue_timeout=5)
    model, admission = router.admit(_request())
    first = await router.place(model, admission)
    second = await router.place(model, admission)
    assert {first.replica.name, second.replica.name} == {"r0", "r1"}
    waiting = [asyncio.create_task(router.place(model, admission)) for _ in range(2)]
    await wait_until_async(lambda: router.queued("m") == 2, 5, "two queued", every=0.001)
    assert router.queued("m") == 2 and not any(t.done() for t in waiting)
    with pytest.raises(Overloaded) as full:
        await router.place(model, admission)  # queue full: 429 at once
    assert full.value.status == 429 and full.value.headers["retry-after"]
    assert b"Model is overloaded" in full.value.body(Api.TGI)
    first.lease.close()
    third = await asyncio.wait_for(waiting[0], 1)
    assert third.replica is first.replica and third.queued_for > 0
    assert not waiting[1].done()
    second.lease.close()
    fourth = await asyncio.wait_for(waiting[1], 1)
    assert fourth.replica is second.replica
    for placement in (third, fourth):
        placement.lease.close()
    assert router.queued("m") == 0
    assert all(router.ledger.load(r.name).in_flight == 0 for r in rs)


async def test_router_queue_times_out_with_429_and_leaves_nothing() -> None:
    rs = replicas(1)
    router = _router(rs, max_in_flight_per_replica=1, queue_timeout=0.2)
    model, admission = router.admit(_request())
    held = await router.place(model, admission)
    with pytest.raises(Overloaded):
        await router.place(model, admission)
    assert router.queued("m") == 0
    held.lease.close()
    assert router.ledger.load("r0").in_flight == 0


async def test_engine_limit_applies_and_unavailable_replicas_are_skipped() -> None:
    rs = replicas(3)
    rs[0].max_concurrent_requests = 1
    rs[1].draining = True
    rs[2].healthy = False
    router = _router(rs, queue_timeout=0.2)
    model, admission = router.admit(_request())
    held = await router.place(model, admission)
    assert held.replica is rs[0]
    with pytest.raises(Overloaded):
        await router.place(model, admission)
    with pytest.raises(NoReplicaAvailable):
        await router.place(model, admission, exclude=[rs[0]])
    held.lease.close()
