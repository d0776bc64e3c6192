"""Recent per-request figures of each pool, for the canary verdict.

Prometheus histograms keep counts per bucket, not the values a rank test needs, so each
process keeps a bounded ring of its latest requests per (model, pool): one small tuple per
finished request (or failed attempt), the oldest dropped first. A shadow pool also keeps its
latest pairs (``PairSample``: did the copy say what the primary said? or was it dropped, or
never sent?). A verdict
reads the samples of a time window from both pools, so both sides cover the same traffic
period.

With ``redis_url`` every record is also queued for the fleet's store (``outbox``), which a
background task sends to Redis in batches (gateway/canary/fleet_samples.py): recording never
waits on the network.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple


class Sample(NamedTuple):
    at: float                     # wall-clock time it ended (time.time())
    error: bool                   # the replica failed it (5xx, timeout, broken connection)
    ttft: float | None            # seconds: streams only
    itl: float | None             # mean seconds between tokens: streams of 2+ tokens
    e2e: float | None             # seconds: served requests
    tokens_per_s: float | None    # generated tokens / decode time: streams of 2+ tokens


class PairSample(NamedTuple):
    """One primary offered a copy to a shadow pool, as the verdict judges it."""

    at: float                     # wall-clock time the later side ended (or the copy skipped)
    greedy: bool                  # temperature 0 (or TGI without sampling)
    compared: bool                # False: dropped (a side failed, or too long) or skipped
    agreed: bool                  # the two texts are identical
    prefix_agreed: bool           # their first ``prefix_chars`` characters are
    skipped: bool = False         # the copy was never sent (no free shadow slot, or refused)


Record = Sample | PairSample
# Called with (model, pool, record) for every record: the fleet store's outbox.
Outbox = Callable[[str, str, Record], None]


class SampleBook:
    def __init__(self, per_pool: int = 5000) -> None:
        self.per_pool = per_pool
        self._rings: dict[tuple[str, str], deque[Sample]] = {}
        self._pairs: dict[tuple[str, str], deque[PairSample]] = {}
        self.outbox: Outbox | None = None

    def _ring(self, rings: dict, model: str, pool: str) -> deque:
        ring = rings.get((model, pool))
        if ring is None:
            ring = rings[(model, pool)] = deque(maxlen=self.per_pool)
        return ring

    def record(self, model: str, pool: str, sample: Sample) -> None:
        self._ring(self._rings, model, pool).append(sample)
        if self.outbox is not None:
            self.outbox(model, pool, sample)

    def served(self, model: str, pool: str, ttft: float | None, itl: float | None,
               e2e: float, tokens_per_s: float | None) -> None:
        self.record(model, pool, Sample(time.time(), False, ttft, itl, e2e, tokens_per_s))

    def failed(self, model: str, pool: str) -> None:
        self.record(model, pool, Sample(time.time(), True, None, None, None, None))

    def paired(self, model: str, pool: str, pair: PairSample) -> None:
        """A shadow pool's pair ended (compared or dropped), or its copy was skipped."""
        self._ring(self._pairs, model, pool).append(pair)
        if self.outbox is not None:
            self.outbox(model, pool, pair)

    def window(self, model: str, pool: str, since: float) -> list[Sample]:
        """The pool's samples that ended at or after ``since`` (wall-clock seconds)."""
        return [s for s in self._rings.get((model, pool), ()) if s.at >= since]

    def pairs_window(self, model: str, pool: str, since: float) -> list[PairSample]:
        """The shadow pool's pairs that ended at or after ``since``."""
        return [p for p in self._pairs.get((model, pool), ()) if p.at >= since]
