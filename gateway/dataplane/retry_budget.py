"""A retry budget: retries may add at most a fixed share to the requests of the last seconds.

Per-request attempt limits alone let retries multiply an outage (every request tried three
times triples the load on what is left). As in Finagle and Envoy, retries are also capped
by a budget: ``ratio`` retries per request over a sliding window, plus a small floor so
that a quiet gateway can still retry.
"""

from __future__ import annotations

import time
from typing import Callable

WINDOW_SECONDS = 10


class RetryBudget:
    def __init__(self, ratio: float, min_per_second: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio = ratio
        self.floor = min_per_second * WINDOW_SECONDS
        self.clock = clock
        # One slot per second of the window: [second, requests, retries].
        self._slots = [[-1, 0, 0] for _ in range(WINDOW_SECONDS)]

    def _slot(self) -> list[int]:
        second = int(self.clock())
        slot = self._slots[second % WINDOW_SECONDS]
        if slot[0] != second:
            slot[0], slot[1], slot[2] = second, 0, 0
        return slot

    def request(self) -> None:
        """Count one client request (first attempts only)."""
        self._slot()[1] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget if there is room."""
        now = int(self.clock())
        requests = retries = 0
        for second, n_requests, n_retries in self._slots:
            if now - second < WINDOW_SECONDS:
                requests += n_requests
                retries += n_retries
        if retries >= self.floor + self.ratio * requests:
            return False
        self._slot()[2] += 1
        return True
