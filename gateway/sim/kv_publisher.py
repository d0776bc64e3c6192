"""The simulated engine's KV-cache events on ZMQ, as vLLM 0.32's ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``) sends them:

- a PUB socket, bound; each batch (one engine step's events) is three frames: the topic,
  the sequence number (8 bytes, big-endian; 0 first, one more per batch) and the payload,
  ``gateway.sim.kv_wire.encode_batch(ts, events, rank=0)`` (msgpack ``[ts, [events...], 0]``,
  the simulator's own encoding of vLLM's structs);
- the last ``buffer_steps`` batches (10,000) kept for replay;
- a ROUTER replay socket, bound: ``[identity, b"", start]`` (8 bytes, big-endian) is
  answered with ``[identity, b"", topic, seq, payload]`` for every buffered batch from
  ``start`` on, then ``[identity, b"", b"", -1 (8 bytes, signed), b""]``; a request of
  another shape is ignored. (vLLM before the topic frame answered ``[identity, b"", seq,
  payload]``; 0.32 sends the topic too.)

Faults for tests of a subscriber (``POST /sim/faults``): ``kv_garbage`` N sends N malformed
messages, one before each of the next batches, in turn: two frames instead of three, a
payload that is no batch (numbered and buffered, as the engine would have), an unknown event
type inside the batch's own payload; ``kv_skip`` N leaves the next N batches out of the live
stream (still numbered and buffered: a subscriber sees a gap it can replay).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import zmq
import zmq.asyncio

from gateway.kvcache.events import KvEvent
from gateway.sim.kv_wire import encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # vLLM's buffer_steps default
HWM = 100_000  # vLLM's hwm default
NOT_A_BATCH = b"\xc1 not a batch"  # 0xc1: never used by msgpack
UNKNOWN_EVENT = "BlockMoved"


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str  # tcp://host:port, bound
    replay_endpoint: str | None = None
    topic: str = "kv"
    positional: bool = False  # each event a positional array (vLLM before 0.32)
    buffer_steps: int = BUFFER_STEPS


def tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KvEventPublisher:
    """Owned by the simulated replica: ``start`` in its startup, ``publish`` after each
    engine step with events, ``stop`` at shutdown."""

    def __init__(self, config: PublisherConfig, faults: Any = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.faults = faults  # gateway.sim.faults.Faults: kv_garbage, kv_skip
        self.wall = wall
        self.topic = config.topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0
        self.garbage_sent = 0
        self.skipped = 0
        self.replays = 0
        self._garbage_turn = 0
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Bind both sockets (an address in use fails the replica's startup)."""
        context = self._context = zmq.asyncio.Context()
        self._pub = self._bind(context, zmq.PUB, self.config.endpoint)
        self._pub.set_hwm(HWM)
        if self.config.replay_endpoint is not None:
            self._router = self._bind(context, zmq.ROUTER, self.config.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    @staticmethod
    def _bind(context: zmq.asyncio.Context, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
        return sock

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(0)
        if self._context is not None:
            self._context.term()

    def state(self) -> dict[str, Any]:
        return {"endpoint": self.config.endpoint, "replay_endpoint": self.config.replay_endpoint,
                "topic": self.config.topic, "next_seq": self.next_seq,
                "buffered": len(self.buffer), "garbage_sent": self.garbage_sent,
                "skipped": self.skipped, "replays": self.replays}

    async def publish(self, events: list[KvEvent]) -> None:
        """One batch: numbered, buffered, sent (unless a fault says otherwise)."""
        assert self._pub is not None, "start() first"
        payload = encode_batch(self.wall(), events, rank=0, positional=self.config.positional)
        faults = self.faults
        if faults is not None and faults.kv_garbage > 0:
            faults.kv_garbage -= 1
            self.garbage_sent += 1
            turn, self._garbage_turn = self._garbage_turn, (self._garbage_turn + 1) % 3
            if turn == 0:
                await self._pub.send_multipart([self.topic, b"garbage"])
            elif turn == 1:
                await self._send(self._number(NOT_A_BATCH), NOT_A_BATCH)
            else:
                payload = self._with_unknown_event(payload)
        seq = self._number(payload)
        if faults is not None and faults.kv_skip > 0:
            faults.kv_skip -= 1
            self.skipped += 1
            return
        await self._send(seq, payload)

    def _number(self, payload: bytes) -> int:
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        return seq

    async def _send(self, seq: int, payload: bytes) -> None:
        assert self._pub is not None
        await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _with_unknown_event(self, payload: bytes) -> bytes:
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        unknown: Any = ([UNKNOWN_EVENT, [1]] if self.config.positional
                        else {"type": UNKNOWN_EVENT, "block_hashes": [1]})
        return msgpack.packb([ts, [*events, unknown], rank], use_bin_type=True)

    async def _serve_replays(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and answers nothing
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")  # vLLM reads it unsigned
            self.replays += 1
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart(
                        [identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([identity, b"", b"", END_SEQ, b""])
