"""Send each request to the replica that owes the fewest tokens.

Request counts are blind to size: a 30k-token prompt and a 10-token one weigh the same.
Outstanding tokens (prompt not yet prefilled + output still expected) weigh the work itself.
"""

from __future__ import annotations

import random
from typing import Sequence

from gateway.balance.ledger import LoadLedger
from gateway.balance.policy import Policy, RequestCost, pick_lowest
from gateway.fleet.replica import Replica


class LeastOutstandingTokens(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica:
        return pick_lowest(replicas, lambda r: ledger.load(r.name).outstanding_tokens, self.rng)
