"""Recent per-request figures of each pool, for the canary verdict.

Prometheus histograms keep counts per bucket, not the values a rank test needs, so each
process keeps a bounded ring of its latest requests per (model, pool): one small tuple per
finished request (or failed attempt), the oldest dropped first. A verdict reads the samples
of a time window from both pools, so both sides cover the same traffic period.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple


class Sample(NamedTuple):
    at: float                     # wall-clock time it ended (time.time())
    error: bool                   # the replica failed it (5xx, timeout, broken connection)
    ttft: float | None            # seconds: streams only
    itl: float | None             # mean seconds between tokens: streams of 2+ tokens
    e2e: float | None             # seconds: served requests
    tokens_per_s: float | None    # generated tokens / decode time: streams of 2+ tokens


class SampleBook:
    def __init__(self, per_pool: int = 5000) -> None:
        self.per_pool = per_pool
        self._rings: dict[tuple[str, str], deque[Sample]] = {}

    def record(self, model: str, pool: str, sample: Sample) -> None:
        ring = self._rings.get((model, pool))
        if ring is None:
            ring = self._rings[(model, pool)] = deque(maxlen=self.per_pool)
        ring.append(sample)

    def served(self, model: str, pool: str, ttft: float | None, itl: float | None,
               e2e: float, tokens_per_s: float | None) -> None:
        self.record(model, pool, Sample(time.time(), False, ttft, itl, e2e, tokens_per_s))

    def failed(self, model: str, pool: str) -> None:
        self.record(model, pool, Sample(time.time(), True, None, None, None, None))

    def window(self, model: str, pool: str, since: float) -> list[Sample]:
        """The pool's samples that ended at or after ``since`` (wall-clock seconds)."""
        return [s for s in self._rings.get((model, pool), ()) if s.at >= since]
