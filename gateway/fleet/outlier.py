"""Passive outlier ejection: replicas that fail real requests in a row sit out for a while.

Active probes only see an engine's health endpoint; a replica can pass them and still fail
every request (a wedged GPU, a stalled scheduler). Each attempt's outcome on a replica is
reported here by the ``OutlierRecord`` outcome listener (``gateway.dataplane.listeners``),
except a canary shadow copy's: a copy neither counts towards an ejection nor clears one.
``consecutive_failures`` failed attempts in a row eject the replica for ``base_ejection``
seconds, doubling with each ejection that follows without a success in between (capped at
``max_ejection``). Like Envoy's ``max_ejection_percent``, never more than a share of a
model's replicas is ejected at once, so a fleet-wide fault degrades instead of emptying it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from gateway.config import OutlierConfig
from gateway.fleet.replica import Replica

log = logging.getLogger(__name__)


class OutlierDetector:
    def __init__(self, config: OutlierConfig, peers: Callable[[Replica], Sequence[Replica]],
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.peers = peers  # the replicas of the same model (for the ejection cap)
        self.clock = clock
        self._failures: dict[str, int] = {}  # consecutive failed requests
        self._ejections: dict[str, int] = {}  # ejections since the last success

    def success(self, replica: Replica) -> None:
        if self._failures.get(replica.name) or self._ejections.get(replica.name):
            self._failures[replica.name] = 0
            self._ejections[replica.name] = 0

    def failure(self, replica: Replica) -> None:
        failures = self._failures.get(replica.name, 0) + 1
        self._failures[replica.name] = failures
        if failures < self.config.consecutive_failures or replica.ejected:
            return
        peers = self.peers(replica)
        ejected = sum(1 for r in peers if r.ejected)
        if (ejected + 1) * 100 > self.config.max_ejected_percent * len(peers):
            return  # the cap: keep serving on it rather than on nothing
        times = self._ejections.get(replica.name, 0)
        seconds = min(self.config.base_ejection * 2 ** times, self.config.max_ejection)
        replica.ejected_until = self.clock() + seconds
        self._ejections[replica.name] = times + 1
        self._failures[replica.name] = 0
        log.warning("replica %s ejected for %gs after %d failed requests in a row",
                    replica.name, seconds, failures)

    def forget(self, replica: Replica) -> None:
        self._failures.pop(replica.name, None)
        self._ejections.pop(replica.name, None)
