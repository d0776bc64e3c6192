"""Where a verdict's samples come from: this instance's rings, or the fleet's store in Redis.

Without ``redis_url`` a verdict judges the requests this instance served, and says so. With
it, the fleet's (gateway/canary/fleet_samples.py): the same records whichever instance is
asked, with the number of instances that contributed; when Redis does not answer, this
instance's records again, and the answer says it fell back.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.canary.judging import Plan, Records, read_local
from gateway.canary.samples import SampleBook

log = logging.getLogger(__name__)

INSTANCE_ONLY = "no redis_url: this instance's requests only"


class SampleSource:
    def __init__(self, book: SampleBook) -> None:
        self.book = book

    async def read(self, judged: Plan, start: float) -> tuple[Records, dict[str, Any]]:
        """The plan's records since ``start`` and where they came from."""
        return read_local(self.book, judged, start), {"scope": "instance", "instances": 1,
                                                      "note": INSTANCE_ONLY}
