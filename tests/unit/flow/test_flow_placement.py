"""Flow control in placement (gateway/dataplane/placement.py with gateway/flow): a saturated
fleet holds requests at the gateway in priority order and sheds sheddable ones; a latency
objective steers the pick to a replica predicted to meet it; every lease returns to 0."""

from __future__ import annotations

import asyncio

import pytest

from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import Policy, make_policy
from gateway.config import BackpressureConfig, FlowControlConfig
from gateway.engines import EngineSignals
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.flow.objective import Objective
from gateway.protocol.errors import ObjectiveUnattainable, Shed
from gateway.protocol.openai import parse_completion
from routing import Routing
from support import wait_until_async


def fleet(n: int = 1) -> tuple[list[Replica], ServedModel]:
    replicas = [Replica(f"r{i}", f"http://r{i}", "vllm", "m", "default", max_model_len=4096)
                for i in range(n)]
    return replicas, ServedModel("m", [Pool("default", 100, replicas)], None, 4096, 16)


def saturate(replica: Replica, waiting: int, now: float, ledger: InProcessLedger) -> None:
    replica.signals = EngineSignals(running=4, waiting=waiting, kv_usage=0.3, scraped_at=now,
                                    ledger_in_flight=ledger.load(replica.name).in_flight)


def routing(replicas: list[Replica], model: ServedModel, clock: list[float],
            policy: Policy | None = None, **flow: object) -> Routing:
    return Routing({"m": model}, policy or make_policy("least_outstanding_tokens"),
                   InProcessLedger(), BackpressureConfig(queue_timeout=10),
                   flow=FlowControlConfig(**flow), clock=lambda: clock[0])


def admission(r: Routing, prompt: str = "hi"):  # type: ignore[no-untyped-def]
    return r.admit(parse_completion(
        b'{"model": "m", "prompt": "%s", "max_tokens": 16}' % prompt.encode()))[1]


async def test_saturated_replicas_hold_requests_in_priority_order_and_shed_the_sheddable() -> None:
    clock = [100.0]
    (r0,), model = fleet()
    r = routing([r0], model, clock)
    adm = admission(r)
    running = [await r.place(model, adm) for _ in range(2)]
    saturate(r0, 5, clock[0], r.ledger)  # the engine's own queue is at the threshold
    with pytest.raises(Shed) as shed:
        await r.place(model, adm, objective=Objective(priority=-1))
    assert shed.value.status == 429 and shed.value.headers["retry-after"] == "1"
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        placement = await r.place(model, adm, objective=Objective(priority=priority))
        order.append(name)
        running.append(placement)

    tasks = [asyncio.create_task(one("batch", 0))]
    await wait_until_async(lambda: r.queued("m") == 1, 5, "batch queued", every=0.001)
    tasks.append(asyncio.create_task(one("chat", 1)))
    await wait_until_async(lambda: r.queued("m") == 2, 5, "chat queued", every=0.001)
    assert r.ledger.load("r0").in_flight == 2  # nothing more was sent to the engine
    running.pop(0).lease.close()  # one ends: one waiting request enters the engine ...
    await wait_until_async(lambda: len(order) == 1, 5, "one placed", every=0.001)
    assert order == ["chat"]  # ... the higher band's, though the batch one came first
    running.pop(0).lease.close()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["chat", "batch"]
    for placement in running:
        placement.lease.close()
    assert r.queued("m") == 0 and r.ledger.load("r0").in_flight == 0


async def test_without_saturation_nothing_is_held_or_shed() -> None:
    clock = [100.0]
    (r0,), model = fleet()
    r = routing([r0], model, clock, saturation=False)
    saturate(r0, 50, clock[0], r.ledger)
    placement = await asyncio.wait_for(
        r.place(model, admission(r), objective=Objective(priority=-1)), 1)
    placement.lease.close()
    assert r.ledger.load("r0").in_flight == 0


class FirstListed(Policy):
    """Picks the first candidate: whatever the objective filter leaves."""

    def select(self, replicas, cost, ledger):  # type: ignore[no-untyped-def]
        return replicas[0]


async def test_an_objective_goes_to_a_replica_predicted_to_meet_it() -> None:
    clock = [100.0]
    replicas, model = fleet(2)
    r = routing(replicas, model, clock, FirstListed(), saturation=False)
    latency = r.placer.latency
    busy = [await r.place(model, admission(r)) for _ in range(20)]  # all on r0
    assert {p.replica.name for p in busy} == {"r0"}
    learned = latency.of(replicas[0])
    for in_flight in range(40):  # 10 ms, and 10 ms more per request in the batch
        learned.observe((1.0, 0.0, float(in_flight + 1)), 0.01 * (in_flight + 2), 0.01)
    assert latency.of(replicas[1]) is learned  # one model per pool and role
    placed = await r.place(model, admission(r), objective=Objective(ttft_ms=100))
    assert placed.replica.name == "r1"  # r0 (21 in its batch) is predicted at ~220 ms
    assert placed.prediction is not None and placed.prediction.ttft == pytest.approx(0.02, 0.1)
    placed.lease.close()
    loose = await r.place(model, admission(r), objective=Objective(ttft_ms=1000))
    assert loose.replica.name == "r0"  # both meet it: the policy's pick
    loose.lease.close()
    for p in busy[:19]:
        p.lease.close()
    more = [await r.place(model, admission(r)) for _ in range(20)]  # r0: 21 in flight
    best_effort = await r.place(model, admission(r), objective=Objective(ttft_ms=15))
    assert best_effort.replica.name == "r0"  # nobody meets it (r1: 20 ms): served anyway
    best_effort.lease.close()
    with pytest.raises(ObjectiveUnattainable) as refused:
        await r.place(model, admission(r), objective=Objective(ttft_ms=15, strict=True))
    assert refused.value.status == 429
    for p in [busy[19], *more]:
        p.lease.close()
    assert all(r.ledger.load(x.name).in_flight == 0 for x in replicas)


@pytest.mark.parametrize("ageing", [0.2, 0.0])
async def test_ageing_serves_a_low_band_under_a_flood_of_a_higher_one(ageing: float) -> None:
    """A replica taking one request at a time, a priority-1 flood that always has waiters:
    with strict order (``ageing_seconds: 0``) the priority-0 request waits as long as the
    flood lasts; with ageing it is served within about ``ageing_seconds``."""
    (r0,), model = fleet()
    r = Routing({"m": model}, make_policy("least_outstanding_tokens"), InProcessLedger(),
                BackpressureConfig(max_in_flight_per_replica=1, queue_timeout=30),
                flow=FlowControlConfig(ageing_seconds=ageing))
    adm = admission(r)
    served: list[str] = []
    stop = asyncio.Event()

    async def one(name: str, priority: int) -> None:
        placement = await r.place(model, adm, objective=Objective(priority=priority))
        served.append(name)
        await asyncio.sleep(0.01)
        placement.lease.close()

    async def flood() -> None:
        tasks: set[asyncio.Task] = set()
        while not stop.is_set():
            tasks = {t for t in tasks if not t.done()}
            while len(tasks) < 4:
                tasks.add(asyncio.create_task(one("chat", 1)))
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)

    flooding = asyncio.create_task(flood())
    await wait_until_async(lambda: len(served) >= 3, 5, "the flood to run", every=0.001)
    before = len(served)
    batch = asyncio.create_task(one("batch", 0))
    await wait_until_async(lambda: "batch" in served or len(served) >= before + 100, 10,
                           "the batch request, or 100 of the flood's", every=0.001)
    stop.set()
    await asyncio.wait_for(asyncio.gather(flooding, batch), 5)
    waited_for = served.index("batch") - before  # flood requests served while it waited
    if ageing:
        assert 0 < waited_for < 60, served  # ~0.2 s of 10 ms requests, then its turn
    else:
        assert waited_for >= 100  # only once the flood stopped
    assert r.queued("m") == 0 and r.ledger.load("r0").in_flight == 0


async def test_a_slot_promised_to_a_higher_band_is_not_taken_by_a_waiter_rechecking(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters also re-check for slots on a timer (slots freed where no lease closes here).
    With the timer made very short, a lower band's waiter is re-checking whenever a slot
    frees; the slot was promised to the higher band's waiter, which gets it every time."""
    import gateway.dataplane.placement as placement

    monkeypatch.setattr(placement, "_RECHECK_SECONDS", 0.0005)
    (r0,), model = fleet()
    r = Routing({"m": model}, make_policy("least_outstanding_tokens"), InProcessLedger(),
                BackpressureConfig(max_in_flight_per_replica=1, queue_timeout=10))
    adm = admission(r)
    for _ in range(20):
        busy = await r.place(model, adm)
        order: list[str] = []

        async def one(name: str, priority: int) -> None:
            placement_ = await r.place(model, adm, objective=Objective(priority=priority))
            order.append(name)
            await asyncio.sleep(0.002)
            placement_.lease.close()

        low = asyncio.create_task(one("batch", 0))
        await wait_until_async(lambda: r.queued("m") == 1, 5, "batch queued", every=0.001)
        high = asyncio.create_task(one("chat", 1))
        await wait_until_async(lambda: r.queued("m") == 2, 5, "chat queued", every=0.001)
        await asyncio.sleep(0.003)  # both re-checking by now
        busy.lease.close()
        await asyncio.wait_for(asyncio.gather(low, high), 5)
        assert order == ["chat", "batch"]
    assert r.queued("m") == 0 and r.ledger.load("r0").in_flight == 0
