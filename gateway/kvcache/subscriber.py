"""One replica's KV events: a ZMQ SUB socket on the engine's publisher, a DEALER on its replay
socket, feeding the replica's ``ReplicaBlocks``.

The publisher's protocol (vLLM's ``ZmqEventPublisher``): each message is three frames, the
topic, an 8-byte big-endian sequence number (0 at the engine's start, one per batch) and the
payload; the replay socket (ROUTER) answers ``[b"", start]`` with every buffered batch from
``start`` on, as ``[b"", topic, seq, payload]`` (vLLM 0.32; before, ``[b"", seq, payload]``:
both are read), then one with sequence -1.

Sequence numbers keep the index whole:
- a gap (or a reconnect after a disconnect) asks the replay socket from the last one seen on;
  what it can no longer give (or a gap with no replay socket) clears the index, since a
  removal may be among what was missed;
- a number at or below the last one, not a replayed duplicate, is a restarted engine: clear.

A message that cannot be read is counted and dropped, logged at most once a minute; nothing
on the socket ends the subscription.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.kvcache.events import EventBatch, MalformedBatch
from gateway.kvcache.index import ReplicaBlocks

log = logging.getLogger("gateway.kvcache")

END_OF_REPLAY = -1
REPLAY_TIMEOUT = 2.0  # seconds for the replay socket's answer
LOG_EVERY = 60.0  # seconds between log lines about one replica's unreadable messages


@dataclass
class FeedStats:
    """What one subscription saw, for the metrics (counters only grow)."""

    events: Counter[str] = field(default_factory=Counter)  # by event type
    dropped: Counter[str] = field(default_factory=Counter)  # by reason
    replays: Counter[str] = field(default_factory=Counter)  # by outcome
    cleared: Counter[str] = field(default_factory=Counter)  # index cleared, by cause
    lag: float | None = None  # seconds from the engine's publishing to our reading, last batch
    last_seq: int | None = None


class EventSubscriber:
    def __init__(self, replica: str, endpoint: str, replay_endpoint: str | None, topic: str,
                 decode: Callable[[bytes], EventBatch], blocks: ReplicaBlocks,
                 context: zmq.asyncio.Context, wall: Callable[[], float] = time.time) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.decode = decode
        self.blocks = blocks
        self.context = context
        self.wall = wall
        self.stats = FeedStats()
        self._replayed_from: int | None = None  # live numbers from here up are duplicates
        self._logged_at = -LOG_EVERY
        self._was_connected = False

    async def run(self) -> None:
        """Subscribe until cancelled; ZMQ reconnects by itself after a drop."""
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._connection_event(await monitor.recv_multipart())
                if sub in ready:
                    await self.receive(await sub.recv_multipart())
        finally:
            self.blocks.connected = False
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _connection_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.blocks.connected = True
            if self._was_connected and self.stats.last_seq is not None:
                await self.replay(self.stats.last_seq + 1)  # what passed while we were away
            self._was_connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.blocks.connected = False

    async def receive(self, frames: list[bytes]) -> None:
        """One live message."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._drop("malformed message", f"{len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self.stats.last_seq
        if last is not None and seq <= last:
            if self._replayed_from is not None and seq >= self._replayed_from:
                return  # already applied from the replay
            self._clear("restart")  # numbering began again: a new engine
        elif last is not None and seq > last + 1:
            self.stats.dropped["gap"] += seq - last - 1
            clears = sum(self.stats.cleared.values())
            await self.replay(last + 1)
            if self.stats.last_seq is not None and seq <= self.stats.last_seq:
                return  # the replay brought it
            if (self.stats.last_seq or 0) < seq - 1 and sum(self.stats.cleared.values()) == clears:
                self._clear("gap")  # the replay did not bring what was missed
        self._replayed_from = None
        self._apply(seq, frames[2])

    async def replay(self, start: int) -> None:
        """Batches from ``start`` on, from the replay socket; clear what cannot be had."""
        if self.replay_endpoint is None:
            self.stats.replays["unavailable"] += 1
            self._clear("gap")
            return
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        first: int | None = None
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT * 1000):
                    self.stats.replays["timeout"] += 1
                    self._clear("gap")
                    return
                frames = await dealer.recv_multipart()
                if len(frames) == 4:  # with the topic (vLLM 0.32)
                    del frames[1]
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._drop("malformed replay", f"{len(frames)} frames")
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                if first is None:
                    first = seq
                    if seq > start:  # the engine's buffer no longer holds what we missed
                        self._clear("gap")
                if self.stats.last_seq is None or seq > self.stats.last_seq:
                    self._apply(seq, frames[2])
        finally:
            dealer.close(0)
        self.stats.replays["ok" if first is None or first <= start else "incomplete"] += 1
        self._replayed_from = start

    def _apply(self, seq: int, payload: bytes) -> None:
        self.stats.last_seq = seq
        try:
            batch = self.decode(payload)
        except MalformedBatch as exc:
            self._drop("malformed batch", str(exc))
            return
        self.blocks.apply(batch)
        for event in batch.events:
            self.stats.events[type(event).__name__] += 1
        for reason in batch.dropped:
            self._drop(reason, "an event")
        self.stats.lag = max(0.0, self.wall() - batch.ts)

    def _clear(self, cause: str) -> None:
        self.blocks.clear()
        self.stats.cleared[cause] += 1

    def _drop(self, reason: str, detail: str) -> None:
        self.stats.dropped[reason] += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            log.warning("replica %s: dropped a KV event message it could not read (%s: %s); "
                        "further ones are counted, logged at most once a minute",
                        self.replica, reason, detail)
