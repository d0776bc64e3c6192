"""Scale from zero (gateway/autoscale/hold.py): held requests go on in priority order once a
replica is available; past the timeout a 503 naming why; a model with replicas, even all
down, is never held; nothing stays behind."""

from __future__ import annotations

import asyncio

import pytest

from gateway.autoscale.config import ScaleFromZeroConfig
from gateway.autoscale.hold import ScaleFromZero
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.errors import ScaledToZero


def model() -> ServedModel:
    return ServedModel("m", [Pool("default", 100, [])], None, 4096, 16)


async def test_held_requests_go_on_highest_priority_first_once_a_replica_is_up() -> None:
    served, hold = model(), ScaleFromZero(ScaleFromZeroConfig(timeout=10))
    order: list[str] = []

    async def request(name: str, priority: int) -> None:
        await hold.wait_for_replica(served, priority)
        order.append(name)

    tasks = [asyncio.create_task(request(name, priority))
             for name, priority in (("low", -1), ("first-zero", 0), ("high", 5),
                                    ("second-zero", 0))]
    await asyncio.sleep(0.3)
    assert hold.held("m") == 4 and order == []
    replica = Replica("r", "http://r", "vllm", "m", "default", healthy=False)
    served.pools[0].replicas.append(replica)  # joined, not yet healthy: still held
    await asyncio.sleep(0.3)
    assert order == []
    replica.healthy = True
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == ["high", "first-zero", "second-zero", "low"]
    assert hold.held_by_model() == {}


async def test_past_the_timeout_the_request_is_refused_and_forgotten() -> None:
    hold = ScaleFromZero(ScaleFromZeroConfig(timeout=0.2, retry_after=9))
    with pytest.raises(ScaledToZero) as refused:
        await hold.wait_for_replica(model(), 0)
    assert refused.value.status == 503 and refused.value.headers == {"retry-after": "9"}
    assert "scaled to zero" in refused.value.message
    await asyncio.sleep(0.2)
    assert hold.held_by_model() == {}


async def test_a_client_that_leaves_leaves_nothing_held() -> None:
    served, hold = model(), ScaleFromZero(ScaleFromZeroConfig(timeout=10))
    task = asyncio.create_task(hold.wait_for_replica(served, 0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hold.held("m") == 0
    await hold.stop()


async def test_a_model_with_replicas_is_never_held_even_when_they_are_down() -> None:
    served, hold = model(), ScaleFromZero(ScaleFromZeroConfig(timeout=10))
    served.pools[0].replicas.append(Replica("r", "http://r", "vllm", "m", "default",
                                            healthy=False))
    await asyncio.wait_for(hold.wait_for_replica(served, 0), 1)
    assert hold.held_by_model() == {}


async def test_a_full_hold_refuses_at_once() -> None:
    served, hold = model(), ScaleFromZero(ScaleFromZeroConfig(timeout=10, max_held=1))
    first = asyncio.create_task(hold.wait_for_replica(served, 0))
    await asyncio.sleep(0.05)
    with pytest.raises(ScaledToZero, match="already wait"):
        await hold.wait_for_replica(served, 0)
    first.cancel()
    await hold.stop()


async def test_off_refuses_nothing_here() -> None:
    hold = ScaleFromZero(ScaleFromZeroConfig(enabled=False))
    await asyncio.wait_for(hold.wait_for_replica(model(), 0), 1)
