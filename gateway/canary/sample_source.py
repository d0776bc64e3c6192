"""Where a verdict's samples come from: this instance's rings, or the fleet's store in Redis.

Without ``redis_url`` a verdict judges the requests this instance served, and says so. With
it, the fleet's (gateway/canary/fleet_samples.py): the same records whichever instance is
asked, with the number of instances that contributed; when Redis does not answer, this
instance's records again, and the answer says it fell back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.canary.fleet_samples import FleetSamples, decode_pairs, decode_samples
from gateway.canary.verdict_plan import Plan, Records, read_local
from gateway.canary.samples import SampleBook

log = logging.getLogger(__name__)

INSTANCE_ONLY = "no redis_url: this instance's requests only"


class SampleSource:
    def __init__(self, book: SampleBook, fleet: FleetSamples | None = None) -> None:
        self.book = book
        self.fleet = fleet
        if fleet is not None:
            book.outbox = fleet.queue

    async def read(self, judged: Plan, start: float) -> tuple[Records, dict[str, Any]]:
        """The plan's records since ``start`` and where they came from."""
        if self.fleet is None:
            return read_local(self.book, judged, start), {"scope": "instance", "instances": 1,
                                                          "note": INSTANCE_ONLY}
        try:
            raw = await self.fleet.read(judged.model, judged.pools)
        except Exception as exc:  # noqa: BLE001 - Redis away: judge what this instance has
            log.warning("canary: cannot read the fleet's samples from %s (%s); judging this "
                        "instance's", self.fleet.name, type(exc).__name__)
            return read_local(self.book, judged, start), {
                "scope": "instance", "instances": 1, "fallback": True,
                "note": f"Redis unreachable ({type(exc).__name__}): this instance's requests "
                        "only"}

        def decode() -> tuple[Records, set[str]]:  # tens of thousands of entries: a thread
            tags: set[str] = set()
            records = {pool: (decode_samples(samples, start, tags),
                              decode_pairs(pairs, start, tags))
                       for pool, (samples, pairs) in raw.items()}
            return records, tags

        records, tags = await asyncio.to_thread(decode)
        return records, {"scope": "fleet", "instances": len(tags),
                         "note": f"the fleet's requests ({len(tags)} instances contributed)"}
