"""The autoscale signal of every model, pool and role (gateway/autoscale/autoscaler.py), from
real fleet objects, ledger and placer: pools share the model's arrivals by weight (a pool
scaled to zero keeps its share; a shadow pool its sample), a disaggregated pool is sized per
role, and the signal falls only after scale_down_after."""

from __future__ import annotations

import pytest

from gateway.autoscale.autoscaler import Autoscaler, pool_shares
from gateway.autoscale.config import AutoscaleConfig
from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import make_policy
from gateway.dataplane.placement import Placer
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.fleet.role import Role


def replica(name: str, pool: str, role: Role = Role.BOTH) -> Replica:
    return Replica(name, f"http://{name}", "vllm", "m", pool, role=role)


def autoscaler(model: ServedModel, clock: list[float], **config: object) -> Autoscaler:
    ledger = InProcessLedger()
    placer = Placer(make_policy("least_outstanding_tokens"), ledger)
    return Autoscaler(AutoscaleConfig(**config), {"m": model}, ledger, placer,
                      clock=lambda: clock[0])


def test_pools_share_the_arrivals_by_weight_a_shadow_by_its_sample() -> None:
    model = ServedModel("m", [Pool("stable", 90, [replica("a", "stable")]),
                              Pool("canary", 10, []),
                              Pool("shadow", 0, [], shadow_of="stable", sample=0.5)],
                        None, 4096, 16)
    assert pool_shares(model) == pytest.approx({"stable": 0.9, "canary": 0.1, "shadow": 0.45})


def test_a_pool_scaled_to_zero_is_asked_for_again_and_an_idle_one_falls_later() -> None:
    clock = [1000.0]
    model = ServedModel("m", [Pool("stable", 90, [replica("a", "stable")]),
                              Pool("canary", 10, [])], None, 4096, 16)
    scaler = autoscaler(model, clock, window=10, scale_down_after=30, target_in_flight=5,
                        headroom=0.0)
    first = {s.pool: s for s in scaler.evaluate()}
    assert first["stable"].desired == 1 and first["canary"].desired == 0  # just started
    for i in range(100):  # 10 requests/s for 10 s, each 2 s on its replica
        clock[0] = 1000 + i / 10
        scaler.arrived("m", 100)
        scaler.demand.completed(("m", "stable", Role.BOTH), 50, 2.0, clock[0])
    signals = {s.pool: s for s in scaler.evaluate()}
    # Little: 10/s x 2 s = 20 at once, 5 a replica: 4; the stable pool's 90 % of it.
    assert signals["stable"].raw == pytest.approx(0.9 * 20 / 5, rel=0.1)
    assert signals["canary"].raw > 0  # no replica, its share of the demand: one asked for
    assert signals["canary"].replicas == 0 and signals["canary"].candidates == ()
    clock[0] = 1030  # the window empty; scale_down_after not yet passed since the load
    assert {s.pool: s.raw for s in scaler.evaluate()} == {"stable": 0, "canary": 0}
    assert scaler.signals[0].desired > 1
    clock[0] = 1100
    assert [s.desired for s in scaler.evaluate()] == [0, 0]
    assert scaler.signals[0].candidates == ("a",)  # none wanted: the one there may go


def test_a_disaggregated_pool_is_sized_per_role() -> None:
    clock = [0.0]
    pool = Pool("pd", 100, [replica("p1", "pd", Role.PREFILL), replica("d1", "pd", Role.DECODE),
                            replica("d2", "pd", Role.DECODE)])
    scaler = autoscaler(ServedModel("m", [pool], None, 4096, 16), clock, window=10,
                        target_in_flight=4, headroom=0.0, scale_down_after=0)
    for i in range(50):  # 5/s; a decode takes 4 s, a prefill 0.2 s
        clock[0] = i / 10
        scaler.arrived("m", 2000)
        scaler.demand.completed(("m", "pd", Role.DECODE), 100, 4.0, clock[0])
        scaler.demand.completed(("m", "pd", Role.PREFILL), 0, 0.2, clock[0])
    clock[0] = 5.0
    by_role = {s.role: s for s in scaler.evaluate()}
    assert set(by_role) == {Role.DECODE, Role.PREFILL}
    # 50 arrivals in the 10 s window: 5/s; at 4 a replica, decode 5 x 4 s / 4, prefill
    # 5 x 0.2 s / 4.
    assert by_role[Role.DECODE].raw == pytest.approx(5.0)
    assert by_role[Role.PREFILL].raw == pytest.approx(0.25)
    assert by_role[Role.DECODE].replicas == 2 and by_role[Role.PREFILL].replicas == 1
    assert by_role[Role.DECODE].candidates == by_role[Role.PREFILL].candidates == ()
    # The pool's roles are remembered when it is scaled to zero.
    pool.replicas.clear()
    assert {s.role for s in scaler.evaluate()} == {Role.DECODE, Role.PREFILL}
