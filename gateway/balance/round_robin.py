"""Take the candidates in turn, blind to load (a baseline)."""

from __future__ import annotations

import itertools
from typing import Sequence

from gateway.balance.ledger import LoadLedger
from gateway.balance.policy import Policy, RequestCost
from gateway.fleet.replica import Replica


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica:
        return replicas[next(self._turn) % len(replicas)]
