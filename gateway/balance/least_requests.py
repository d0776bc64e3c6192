"""Send each request to the replica with the fewest in-flight requests (a baseline)."""

from __future__ import annotations

import random
from typing import Sequence

from gateway.balance.ledger import LoadLedger
from gateway.balance.policy import Policy, RequestCost, pick_lowest
from gateway.fleet.replica import Replica


class LeastRequests(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica:
        return pick_lowest(replicas, lambda r: ledger.load(r.name).in_flight, self.rng)
