"""Weighted fair queueing of the requests waiting for a slot (gateway/balance/fair_queue.py),
as pure logic and through the router."""

from __future__ import annotations

import asyncio

import pytest

from gateway.balance.fair_queue import FairQueue
from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import make_policy
from gateway.config import BackpressureConfig
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.errors import Overloaded, QueueFull
from gateway.protocol.openai import parse_completion
from gateway.protocol.request import Caller
from routing import Routing
from support import wait_until_async


async def served_order(queue: FairQueue, arrivals: list[tuple[str | None, float, int]]) -> list:
    """Every arrival parks; then slots free one by one: the flows in the order served."""
    loop = asyncio.get_running_loop()
    tickets = []
    for flow, weight, cost in arrivals:
        ticket = queue.enter(flow, weight, cost)
        queue.park(ticket, loop.create_future())
        tickets.append(ticket)
    order = []
    while queue.wake_one():
        woken = next(t for t in tickets if t.waiter is not None and t.waiter.done())
        order.append(woken.flow)
        queue.leave(woken)
    assert len(queue) == 0
    return order


async def test_a_flood_does_not_push_a_light_key_back() -> None:
    flood = [("flood", 1.0, 500)] * 50
    order = await served_order(FairQueue(), flood + [("light", 1.0, 500)] * 3)
    assert [i for i, f in enumerate(order) if f == "light"] == [1, 3, 5]
    fifo = await served_order(FairQueue(fair=False), flood + [("light", 1.0, 500)] * 3)
    assert [i for i, f in enumerate(fifo) if f == "light"] == [50, 51, 52]


async def test_shares_are_priced_in_tokens() -> None:
    """A key sending 100x bigger requests gets 1/100th of the requests served."""
    big = [("big", 1.0, 30_000)] * 5
    small = [("small", 1.0, 300)] * 300
    order = await served_order(FairQueue(), big + small)
    first = order[:202]
    assert first.count("big") == 2 and first.count("small") == 200


async def test_shares_follow_weights() -> None:
    order = await served_order(FairQueue(), [("gold", 3.0, 100)] * 60 + [("free", 1.0, 100)] * 60)
    first = order[:40]
    assert first.count("gold") == 30 and first.count("free") == 10


async def test_a_key_arriving_late_banks_no_credit() -> None:
    """A key that sent nothing while others were served starts at the current virtual time:
    from then on it gets its share, not a burst for the time it was away."""
    queue, loop = FairQueue(), asyncio.get_running_loop()
    busy = [queue.enter("busy", 1.0, 100) for _ in range(20)]
    for ticket in busy:
        queue.park(ticket, loop.create_future())
    for ticket in busy[:10]:  # half of the busy key's requests are served
        assert queue.wake_one() and ticket.waiter.done()
        queue.leave(ticket)
    late = [queue.enter("late", 1.0, 100) for _ in range(4)]
    for ticket in late:
        queue.park(ticket, loop.create_future())
    order = []
    while queue.wake_one():
        (woken,) = [t for t in [*busy, *late] if t.waiter is not None and t.waiter.done()]
        order.append(woken.flow)
        queue.leave(woken)
    # Alternating from now on (with a tag starting at 0 it would have taken the next 4).
    assert order[:8] == ["busy", "late"] * 4 or order[:8] == ["late", "busy"] * 4


# --- through the router ---------------------------------------------------------------------

def router(**backpressure: object) -> tuple[Routing, ServedModel]:
    replica = Replica("r0", "http://r0", "vllm", "m", "default", max_model_len=4096)
    model = ServedModel("m", [Pool("default", 100, [replica])], None, 4096, 16)
    return Routing({"m": model}, make_policy("least_outstanding_tokens"),
                  InProcessLedger(),
                  BackpressureConfig(max_in_flight_per_replica=1, **backpressure)), model


def admission(r: Routing, max_tokens: int = 16):  # type: ignore[no-untyped-def]
    _, adm = r.admit(parse_completion(
        b'{"model": "m", "prompt": "hi", "max_tokens": %d}' % max_tokens))
    return adm


@pytest.mark.parametrize("queueing, light_place", [("fair", 1), ("fifo", 6)])
async def test_router_serves_the_light_key_between_the_floods_requests(
        queueing: str, light_place: int) -> None:
    r, model = router(queueing=queueing, queue_timeout=10)
    adm = admission(r)
    busy = await r.place(model, adm)
    flood, light = Caller("flood"), Caller("light")
    order: list[str] = []

    async def one(caller: Caller) -> None:
        placement = await r.place(model, adm, caller=caller)
        order.append(caller.name)
        await asyncio.sleep(0)
        placement.lease.close()

    tasks = [asyncio.create_task(one(flood)) for _ in range(6)]
    await wait_until_async(lambda: r.queued("m") == 6, 5, "the flood queued", every=0.001)
    tasks.append(asyncio.create_task(one(light)))
    await wait_until_async(lambda: r.queued("m") == 7, 5, "the light one queued", every=0.001)
    assert r.queued("m") == 7
    busy.lease.close()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order.index("light") == light_place
    assert r.queued("m") == 0 and r.ledger.load("r0").in_flight == 0


async def test_a_keys_share_of_the_queue_is_capped_and_a_timeout_leaves_nothing() -> None:
    r, model = router(max_queued_per_key=2, queue_timeout=0.3)
    adm = admission(r)
    busy = await r.place(model, adm)
    waiting = [asyncio.create_task(r.place(model, adm, caller=Caller("flood"))) for _ in range(2)]
    await wait_until_async(lambda: r.queued("m") == 2, 5, "two of flood queued", every=0.001)
    with pytest.raises(QueueFull) as full:
        await r.place(model, adm, caller=Caller("flood"))
    assert full.value.status == 429 and full.value.reason == "queue_full"
    other = asyncio.create_task(r.place(model, adm, caller=Caller("other")))  # its own share
    await wait_until_async(lambda: r.queued("m") == 3, 5, "other queued", every=0.001)
    assert r.queued("m") == 3
    for task in [*waiting, other]:
        with pytest.raises(Overloaded):
            await task  # nobody freed the slot: each times out
    assert r.queued("m") == 0
    busy.lease.close()
    assert r.ledger.load("r0").in_flight == 0
    again = await r.place(model, adm, caller=Caller("flood"))  # nothing stale holds its place
    again.lease.close()


async def test_without_keys_a_fairness_id_is_the_flow_and_its_share_is_capped() -> None:
    """llm-d's ``x-llm-d-inference-fairness-id``: with keys off, requests of one id share the
    queue as one key's would (capped by max_queued_per_key), apart from another id's."""
    r, model = router(max_queued_per_key=1, queue_timeout=0.3)
    adm = admission(r)
    busy = await r.place(model, adm)
    tenant_a = asyncio.create_task(r.place(model, adm, flow="tenant-a"))
    await wait_until_async(lambda: r.queued("m") == 1, 5, "tenant-a queued", every=0.001)
    with pytest.raises(QueueFull) as full:
        await r.place(model, adm, flow="tenant-a")
    assert "fairness id `tenant-a`" in full.value.message
    tenant_b = asyncio.create_task(r.place(model, adm, flow="tenant-b"))  # its own share
    await wait_until_async(lambda: r.queued("m") == 2, 5, "tenant-b queued", every=0.001)
    for task in (tenant_a, tenant_b):
        with pytest.raises(Overloaded):
            await task
    busy.lease.close()
    assert r.queued("m") == 0


async def test_a_newcomer_does_not_jump_the_queue_when_a_slot_frees() -> None:
    """Between a slot freeing and the first waiter taking it, a new request must not take it."""
    r, model = router(queue_timeout=10)
    adm = admission(r)
    busy = await r.place(model, adm)
    first = asyncio.create_task(r.place(model, adm, caller=Caller("a")))
    await wait_until_async(lambda: r.queued("m") == 1, 5, "a queued", every=0.001)

    async def close_and_send_again() -> object:
        busy.lease.close()  # wakes ``first``, which has not run yet...
        return await r.place(model, adm, caller=Caller("b"))  # ...when this looks for a slot

    newcomer = asyncio.create_task(close_and_send_again())
    placed = await asyncio.wait_for(first, 1)
    await asyncio.sleep(0.01)  # a window in which the newcomer must not be placed
    assert not newcomer.done()
    placed.lease.close()
    (await asyncio.wait_for(newcomer, 1)).lease.close()
    assert r.queued("m") == 0


async def test_a_free_slot_no_waiter_can_use_is_taken_at_once() -> None:
    """A waiter held back by its pool (a sticky key) does not hold back a newcomer that can
    use a free slot elsewhere."""
    from gateway.balance.pool_split import rendezvous

    pools = [Pool("stable", 50, [Replica("s", "http://s", "vllm", "m", "stable",
                                         max_model_len=4096)]),
             Pool("canary", 50, [Replica("c", "http://c", "vllm", "m", "canary",
                                         max_model_len=4096)])]
    r = Routing({"m": ServedModel("m", pools, None, 4096, 16)},
                make_policy("least_outstanding_tokens"), InProcessLedger(),
                BackpressureConfig(max_in_flight_per_replica=1, queue_timeout=10))
    adm = admission(r)
    key = next(f"k{i}" for i in range(100) if rendezvous(pools, f"k{i}").name == "stable")
    busy = await r.place(model=r.models["m"], admission=adm, key=key)
    waiting = asyncio.create_task(r.place(r.models["m"], adm, key=key))
    await wait_until_async(lambda: r.queued("m") == 1, 5, "the keyed request queued", every=0.001)
    assert r.queued("m") == 1
    other = await asyncio.wait_for(r.place(r.models["m"], adm), 0.05)  # no re-check wait
    assert other.replica.name == "c"
    other.lease.close()
    busy.lease.close()
    (await asyncio.wait_for(waiting, 1)).lease.close()
    assert r.queued("m") == 0


# --- priority bands ---------------------------------------------------------------------------

async def test_a_higher_band_goes_first_and_a_waiting_band_ages_up() -> None:
    now = [0.0]
    queue, loop = FairQueue(ageing_seconds=10.0, clock=lambda: now[0]), \
        asyncio.get_running_loop()
    low = queue.enter("batch", 1.0, 100, priority=0)
    queue.park(low, loop.create_future())
    now[0] = 5.0
    highs = [queue.enter("chat", 1.0, 100, priority=1) for _ in range(3)]
    for ticket in highs:
        queue.park(ticket, loop.create_future())
    assert queue.outranked(0) and not queue.outranked(1) and not queue.outranked(2)
    assert queue.wake_one() and highs[0].waiter.done()  # the band above first
    queue.leave(highs[0])
    now[0] = 10.0  # the batch request has waited 10 s: it competes as priority 1, and its
    assert queue.wake_one() and low.waiter.done()  # tag is older than the chat ones'
    queue.leave(low)
    assert queue.wake_one() and highs[1].waiter.done()
    # Ageing counts for the one asking too: a band-0 waiter whose tag is older than band
    # 1's first is not outranked once it has aged to band 1; a newcomer is.
    old = queue.enter("batch", 1.0, 100, priority=0)
    old.entered, old.tag = 0.0, -1.0
    assert queue.outranked(0) and not queue.outranked(0, old)
    old.entered = 5.0  # not aged yet
    assert queue.outranked(0, old)


async def test_strict_bands_without_ageing_and_a_leaver_holds_no_band() -> None:
    queue, loop = FairQueue(ageing_seconds=0), asyncio.get_running_loop()
    high = queue.enter(None, 1.0, 10, priority=3)
    queue.park(high, loop.create_future())
    assert queue.outranked(2)
    queue.leave(high)  # its request stopped waiting (placed elsewhere, timed out)
    assert not queue.outranked(2) and not queue.wake_one() and len(queue) == 0
