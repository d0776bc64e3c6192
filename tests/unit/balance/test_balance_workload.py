"""A heterogeneous burst through the real policies and ledger.

400 requests, 15% of them long (3k-6k-token prompts, long outputs), arrive together, faster
than anything completes. Least-outstanding-tokens should spread the *tokens* evenly (each
replica within one long request of the others), where least-requests spreads the *request
counts* evenly and lets tokens pile up wherever the long ones happen to land.
How that turns into TTFT under a real timing model is measured by the benchmarks.
"""

from __future__ import annotations

import random

from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import RequestCost, policy_class
from gateway.fleet.replica import Replica

REPLICAS = [Replica(name=f"gpu{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm", model="m",
                    pool="default") for i in range(4)]
LONGEST = 6000 + 800


def workload(seed: int, n: int = 400) -> list[RequestCost]:
    rng = random.Random(seed)
    return [RequestCost(rng.randint(3000, 6000), rng.randint(300, 800)) if rng.random() < 0.15
            else RequestCost(rng.randint(50, 300), rng.randint(20, 120)) for _ in range(n)]


def burst(policy_name: str, seed: int) -> tuple[list[int], list[int]]:
    """Tokens and requests each replica holds after the burst (nothing has completed)."""
    ledger = InProcessLedger()
    policy = policy_class(policy_name)(random.Random(seed))
    leases = [ledger.lease(policy.select(REPLICAS, cost, ledger).name, cost.prompt_tokens,
                           cost.output_tokens) for cost in workload(seed)]
    loads = [ledger.load(r.name) for r in REPLICAS]
    tokens, requests = [l.outstanding_tokens for l in loads], [l.in_flight for l in loads]
    for lease in leases:
        lease.close()
    assert all(ledger.load(r.name).outstanding_tokens == 0 for r in REPLICAS)
    return tokens, requests


def spread(values: list[int]) -> int:
    return max(values) - min(values)


def test_least_outstanding_tokens_evens_tokens_where_least_requests_evens_requests() -> None:
    for seed in range(5):
        lot_tokens, lot_requests = burst("least_outstanding_tokens", seed)
        lr_tokens, lr_requests = burst("least_requests", seed)
        assert spread(lot_tokens) <= LONGEST, lot_tokens  # within one request of each other
        assert spread(lr_requests) <= 1, lr_requests
        assert spread(lr_tokens) > 3 * spread(lot_tokens), (lr_tokens, lot_tokens)
        assert spread(lot_requests) > spread(lr_requests), (lot_requests, lr_requests)
