"""Engine load signals: each replica's own queue depth and KV-cache use, scraped from /metrics.

The ledger knows exactly what this gateway sent; the engine knows what it is actually
running, including work other clients sent straight to it. A ``Scraper`` reads each replica's
Prometheus endpoint every ``interval`` seconds and stores the latest ``EngineSignals`` on the
replica; policies blend them in only while they are fresh (see
``gateway/balance/least_expected_work.py``). A failed or slow scrape changes nothing: the old
signals simply grow stale and stop counting.

Which gauges each engine exposes, and how they read, is the engine's (``gateway/engines/``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

import aiohttp

from gateway.engines import EngineSignals
from gateway.fleet.replica import Replica

__all__ = ["EngineSignals", "SignalScraper"]

log = logging.getLogger("gateway.signals")


class SignalScraper:
    """Scrapes every replica of a scrapable engine, every ``interval`` seconds, forever."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], session: aiohttp.ClientSession,
                 in_flight: Callable[[str], int], interval: float, timeout: float) -> None:
        self.replicas = replicas
        self.session = session
        self.in_flight = in_flight  # replica name -> requests the ledger has placed there
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def scrape(self, replica: Replica) -> None:
        """One scrape; on any failure the replica keeps its old (aging) signals."""
        try:
            async with self.session.get(f"{replica.url}/metrics", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        # The ledger's count is read when the answer arrives, the moment the engine's is nearest.
        replica.signals = replica.profile.parse_signals(text, time.monotonic(),
                                                        self.in_flight(replica.name))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(r) for r in self.replicas()
                               if r.profile.signal_metrics is not None))

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_all()
            except Exception:  # never let one bad scrape end the loop
                log.exception("engine signal scrape failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
