"""Active health probes: each replica's own health endpoint, with thresholds both ways."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.config import HealthConfig
from gateway.fleet.discovery import discover_window
from gateway.fleet.replica import Replica

log = logging.getLogger(__name__)


class HealthChecker:
    """Marks replicas down after ``unhealthy_after`` failed probes, up after ``healthy_after``."""

    def __init__(self, replicas: list[Replica], session: aiohttp.ClientSession,
                 config: HealthConfig) -> None:
        self.replicas = replicas
        self.session = session
        self._timeout = aiohttp.ClientTimeout(total=config.timeout)
        self.config = config
        self._streak: dict[str, int] = {}  # >0 consecutive passes, <0 consecutive failures

    async def check(self, replica: Replica) -> bool:
        """One probe of the replica's health endpoint, without recording it."""
        try:
            async with self.session.get(f"{replica.url}/health", timeout=self._timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def probe(self, replica: Replica) -> bool:
        ok = await self.check(replica)
        if ok:
            # An engine that just came up may not have told us its window yet.
            await discover_window(self.session, replica, self.config.timeout)
        self._record(replica, ok)
        return ok

    def _record(self, replica: Replica, ok: bool) -> None:
        streak = self._streak.get(replica.name, 0)
        streak = max(streak, 0) + 1 if ok else min(streak, 0) - 1
        self._streak[replica.name] = streak
        if replica.healthy and -streak >= self.config.unhealthy_after:
            replica.healthy = False
            log.warning("replica %s is unhealthy (%d failed probes)", replica.name, -streak)
        elif not replica.healthy and streak >= self.config.healthy_after:
            replica.healthy = True
            log.warning("replica %s is healthy again", replica.name)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def run(self) -> None:
        """Probe forever at the configured interval (cancel to stop)."""
        while True:
            await self.probe_all()
            await asyncio.sleep(self.config.interval)
