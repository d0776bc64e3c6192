"""The background task that keeps this instance's shared state in step with Redis.

Requests never touch Redis: they read and write local state (the ledger, the replicas), and
this task syncs it, the load ledger and the replica state in one script round trip each:
every ``interval`` seconds, and at once (at most every MIN_GAP) when the ledger has news for
the peers or a peer announced news on the pub/sub channel. Redis down, slow or restarted
only fails rounds: the instance goes on with what it has (fail-open), says so once in the
log and in ``llm_gateway_shared_state_up``, drops peers' load once it is older than
``peer_ttl``, and converges by itself at the first good round (every round re-publishes
everything this instance holds, so a restarted, empty Redis is refilled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Sequence
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError

from gateway.balance.redis_ledger import RedisLedger, instance_id
from gateway.config import Settings
from gateway.fleet.replica import Replica
from gateway.fleet.shared_replica_state import SharedReplicaState
from gateway.metrics import GatewayMetrics, SharedStateMetrics
from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger(__name__)

MIN_GAP = 0.02  # seconds: at most 50 sync rounds per second, however busy


def connect(url: str, timeout: float) -> Redis:
    """A client that fails fast: one immediate retry on a broken connection (a pooled one
    that Redis closed when it restarted), none on a timeout (the next round is the retry)."""
    return Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                          retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
                          decode_responses=True,
                          client_name="llm-gateway")


def redacted(url: str) -> str:
    """The URL without credentials, for logs."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"


class SharedStateSync:
    def __init__(self, redis: Redis, ledger: RedisLedger, replica_state: SharedReplicaState,
                 interval: float, timeout: float, metrics: SharedStateMetrics | None = None,
                 name: str = "redis") -> None:
        self.redis = redis
        self.ledger = ledger
        self.replica_state = replica_state
        self.interval = interval
        self.timeout = timeout
        self.metrics = metrics
        self.name = name  # how logs call the Redis server
        self.up: bool | None = None  # None until the first round
        self.last_success = time.monotonic()  # no peer data yet, so nothing is stale
        self._observed_at = 0.0

    @classmethod
    def from_settings(cls, settings: Settings, replicas: Sequence[Replica]) -> "SharedStateSync":
        """The shared ledger and replica state for ``settings.redis_url`` (not connected yet)."""
        keys = SharedKeys(settings.redis_key_prefix)
        ledger = RedisLedger(keys, instance_id(), settings.redis_peer_ttl)
        return cls(connect(settings.redis_url, settings.redis_timeout), ledger,
                   SharedReplicaState(replicas, keys), settings.redis_sync_interval,
                   settings.redis_timeout, name=redacted(settings.redis_url))

    async def start(self, metrics: GatewayMetrics) -> None:
        """Export the sync's metrics and run a first round (bounded by ``timeout``), so the
        first requests already see the fleet's load when Redis is there."""
        registry = metrics.registry  # None when metrics are off
        if registry is not None:
            self.metrics = SharedStateMetrics(registry)
        await self.round()

    async def round(self, full: bool = True) -> bool:
        """Sync once (the load only unless ``full``: ejections and drains need no haste);
        False (fail-open) if Redis did not answer within ``timeout``."""
        try:
            async with asyncio.timeout(self.timeout):
                await self.ledger.sync(self.redis)
                if full:
                    await self.replica_state.sync(self.redis)
        except Exception as exc:  # noqa: BLE001 - whatever Redis does, requests go on
            self._failed(exc)
            return False
        finally:
            self._observe()
        self.last_success = time.monotonic()
        if self.up is not True:
            log.warning("shared state: in sync with %s (%d other instances)", self.name,
                        len(self.ledger.peers))
            self.up = True
            if self.metrics:
                self.metrics.up.set(1)
        return True

    def _failed(self, exc: Exception) -> None:
        if self.metrics:
            self.metrics.sync_failures.inc()
        if self.up is not False:
            log.warning("shared state: %s unreachable (%s: %s); balancing on this instance's "
                        "own load until it is back", self.name, type(exc).__name__,
                        exc or "timed out")
            self.up = False
            if self.metrics:
                self.metrics.up.set(0)
        if time.monotonic() - self.last_success > self.ledger.peer_ttl:
            self.ledger.stale()

    def _observe(self) -> None:
        """Gauges at most once per interval: rounds can run 50 times a second."""
        now = time.monotonic()
        if self.metrics and now - self._observed_at >= self.interval:
            self._observed_at = now
            self.metrics.peers.set(len(self.ledger.peers))
            for replica, load in self.ledger.snapshot().items():
                self.metrics.view_outstanding.labels(replica).set(load.outstanding_tokens)
                self.metrics.view_in_flight.labels(replica).set(load.in_flight)

    async def run(self) -> None:
        """Sync forever (cancel to stop): every ``interval``, and at once (at most every
        MIN_GAP) when this instance's load changed or a peer announced a change."""
        task = asyncio.current_task()
        listener = asyncio.create_task(self._listen(), name="shared-state-events")
        wake = self.ledger.wake
        try:
            # Checked each round: under Python 3.11 a cancel that lands inside the Redis
            # client's own timeouts can be swallowed, and the task would sync on forever.
            next_full = 0.0
            while task is None or not task.cancelling():
                started = time.monotonic()
                full = started >= next_full
                if full:
                    next_full = started + self.interval
                wake.clear()
                await self.round(full)
                await asyncio.sleep(max(MIN_GAP - (time.monotonic() - started), 0.0))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(next_full - time.monotonic(), 0.0)):
                        await wake.wait()
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def _listen(self) -> None:
        """Wake the sync when a peer announces a change (best effort: without it, peers are
        still read every interval)."""
        task = asyncio.current_task()
        while task is None or not task.cancelling():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.ledger.keys.load_events)
                while task is None or not task.cancelling():
                    message = await pubsub.get_message(timeout=self.interval)
                    if message is not None and message["data"] != self.ledger.instance:
                        self.ledger.wake.set()
            except Exception:  # noqa: BLE001 - Redis down: the rounds report it
                await asyncio.sleep(self.interval)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def close(self) -> None:
        """Leave the shared view at once (best effort, bounded) and close the client."""
        try:
            async with asyncio.timeout(self.timeout):
                await self.ledger.withdraw(self.redis)
        except Exception as exc:  # noqa: BLE001 - peers drop us after the TTL anyway
            log.info("shared state: could not withdraw (%s); peers drop this instance's load "
                     "within %.1fs", type(exc).__name__, self.ledger.peer_ttl)
        await self.redis.aclose()
