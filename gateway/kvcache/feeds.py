"""A KV event subscription for every replica whose engine publishes them, as the fleet
changes: replicas that join (admin API, DNS discovery) are subscribed within a second, those
that leave are let go; a replica that loses its health has its index cleared (an engine that
restarts comes back with an empty cache)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit

import zmq.asyncio

from gateway.config import KvEventsConfig
from gateway.fleet.replica import Replica
from gateway.kvcache.index import ReplicaBlocks
from gateway.kvcache.metrics import KvEventMetrics
from gateway.kvcache.subscriber import EventSubscriber, FeedStats

log = logging.getLogger("gateway.kvcache")

RECONCILE_EVERY = 1.0  # seconds


def endpoints(replica: Replica, config: KvEventsConfig) -> tuple[str, str | None] | None:
    """Where ``replica``'s engine publishes its events and answers replays (None: nowhere
    known)."""
    if replica.kv_events is not None:
        return replica.kv_events, replica.kv_replay
    url = urlsplit(replica.url)
    if url.hostname is None or url.port is None and config.port is None:
        return None
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    port = config.port if config.port is not None else url.port + config.port_offset
    replay = (config.replay_port if config.replay_port is not None
              else None if config.replay_port_offset is None
              else url.port + config.replay_port_offset if url.port is not None else None)
    if not 0 < port < 65536 or replay is not None and not 0 < replay < 65536:
        log.warning("replica %s: the kv_events port rule gives port %s (replay %s), not a "
                    "port: not subscribed", replica.name, port, replay)
        return None
    return f"tcp://{host}:{port}", None if replay is None else f"tcp://{host}:{replay}"


class KvEventFeeds:
    def __init__(self, replicas: Callable[[], Sequence[Replica]], config: KvEventsConfig,
                 metrics: KvEventMetrics | None = None) -> None:
        self.replicas = replicas
        self.config = config
        self.metrics = metrics
        self.context = zmq.asyncio.Context()
        self._feeds: dict[str, tuple[Replica, EventSubscriber, asyncio.Task]] = {}
        self._without: set[str] = set()  # replicas with no events to follow (asked once)
        self._healthy: dict[str, bool] = {}

    def reconcile(self) -> None:
        current = {r.name: r for r in self.replicas()}
        for name in [n for n in self._feeds if n not in current]:
            replica, _, task = self._feeds.pop(name)
            task.cancel()
            replica.kv_cache = None
            self._healthy.pop(name, None)
            if self.metrics is not None:
                self.metrics.forget(name)
        self._without &= set(current)
        for name, replica in current.items():
            if name not in self._feeds and name not in self._without:
                self._subscribe(replica)
            feed = self._feeds.get(name)
            if feed is None:
                continue
            blocks = feed[1].blocks
            if self._healthy.get(name, True) and not replica.healthy:
                feed[1].stats.cleared["health_lost"] += 1
                blocks.clear()
            self._healthy[name] = replica.healthy
            signals = replica.signals  # the engine's own bound and block size
            if signals is not None and signals.kv_blocks:
                blocks.capacity = signals.kv_blocks
            if signals is not None and signals.kv_block_size and blocks.block_size is None:
                blocks.block_size = signals.kv_block_size  # before its first event

    def _subscribe(self, replica: Replica) -> None:
        decode = replica.profile.decode_kv_events
        where = endpoints(replica, self.config) if decode is not None else None
        if where is None:
            self._without.add(replica.name)
            return
        blocks = ReplicaBlocks(self.config.pending_seconds, self.config.stale_after)
        subscriber = EventSubscriber(replica.name, where[0], where[1], self.config.topic,
                                     decode, blocks, self.context)
        task = asyncio.create_task(self._run(subscriber), name=f"kv-events-{replica.name}")
        self._feeds[replica.name] = (replica, subscriber, task)
        replica.kv_cache = blocks
        log.info("replica %s: KV events from %s (replay %s)", replica.name, where[0],
                 where[1] or "none")

    async def _run(self, subscriber: EventSubscriber) -> None:
        while True:  # a bug in one message must not end the replica's subscription
            try:
                await subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replica %s: KV event subscriber failed; starting again",
                              subscriber.replica)
                subscriber.blocks.clear()
                await asyncio.sleep(1.0)

    def feeds(self) -> Iterator[tuple[str, ReplicaBlocks, FeedStats]]:
        """(replica, its index, its subscription's counts), for the metrics."""
        for name, (_, subscriber, _) in list(self._feeds.items()):
            yield name, subscriber.blocks, subscriber.stats

    async def run(self) -> None:
        while True:
            self.reconcile()
            if self.metrics is not None:
                self.metrics.publish(self.feeds())
            await asyncio.sleep(RECONCILE_EVERY)

    async def close(self) -> None:
        tasks = [task for _, _, task in self._feeds.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica, _, _ in self._feeds.values():
            replica.kv_cache = None
        self._feeds.clear()
        self.context.term()
