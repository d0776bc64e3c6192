from __future__ import annotations

import collections
import random

import pytest

from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import RequestCost, make_policy, policy_class
from gateway.fleet.replica import Replica


def replicas(n: int) -> list[Replica]:
    return [Replica(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm", model="m",
                    pool="default") for i in range(n)]


COST = RequestCost(10, 10)


def test_least_outstanding_tokens_picks_least_owed_replica_not_fewest_requests() -> None:
    ledger = InProcessLedger()
    rs = replicas(3)
    ledger.lease("r0", 30000, 100)  # one huge request
    ledger.lease("r1", 10, 10)
    ledger.lease("r1", 10, 10)  # two small ones
    ledger.lease("r2", 500, 500)
    assert make_policy("least_outstanding_tokens").select(rs, COST, ledger).name == "r1"
    assert make_policy("least_requests").select(rs[:2], COST, ledger).name == "r0"


@pytest.mark.parametrize("name", ["least_outstanding_tokens", "least_requests"])
def test_ties_are_broken_at_random_not_by_list_order(name: str) -> None:
    ledger = InProcessLedger()
    rs = replicas(4)
    policy = policy_class(name)(random.Random(7))
    picks = collections.Counter(policy.select(rs, COST, ledger).name for _ in range(400))
    assert set(picks) == {"r0", "r1", "r2", "r3"}
    assert min(picks.values()) > 50


def test_round_robin_takes_turns() -> None:
    rs = replicas(3)
    policy = make_policy("round_robin")
    ledger = InProcessLedger()
    assert [policy.select(rs, COST, ledger).name for _ in range(6)] == ["r0", "r1", "r2"] * 2
