"""The subscriber against a scripted publisher on loopback (real ZMQ sockets, vLLM's frames):
sequence numbers, replay of a gap, a restarted engine, garbage, a disconnect."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from benchmarks.harness import free_port
from gateway.engines.vllm import decode_kv_batch, encode_kv_batch
from gateway.kvcache.events import BlockRemoved, BlockStored
from gateway.kvcache.index import PromptKeys, ReplicaBlocks
from gateway.kvcache.subscriber import EventSubscriber
from support import wait_until_async

SIZE = 2
TOKENS = [7, 8, 9, 10, 11, 12]


def stored(i: int) -> bytes:
    """Block i of TOKENS, chained to block i-1 (engine hash = 100 + i)."""
    event = BlockStored((100 + i,), 100 + i - 1 if i else None,
                        tuple(TOKENS[i * SIZE:(i + 1) * SIZE]), SIZE, medium="GPU")
    return encode_kv_batch(1.0, [event])


class Publisher:
    """vLLM's publisher, scripted: PUB frames [topic, seq, payload]; a ROUTER that replays
    the kept batches from a start sequence, then [b"", b"", -1, b""]."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.kept: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self.task = asyncio.create_task(self._serve_replays())

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replays.append(start_seq)
            for seq, payload in self.kept:
                if seq >= start_seq:
                    await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"),
                                                      payload])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big",
                                                                               signed=True), b""])

    async def send(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.kept.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
async def rig():
    context = zmq.asyncio.Context()
    publisher = Publisher(context)
    blocks = ReplicaBlocks(clock=lambda: 0.0)
    subscriber = EventSubscriber("r0", f"tcp://127.0.0.1:{publisher.port}",
                                 f"tcp://127.0.0.1:{publisher.replay_port}", "kv",
                                 decode_kv_batch, blocks, context)
    task = asyncio.create_task(subscriber.run())
    await wait_until_async(lambda: blocks.connected, timeout=10)
    await asyncio.sleep(0.2)  # PUB/SUB: the subscription reaches the publisher after connect
    yield publisher, subscriber, blocks
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    publisher.close()
    context.term()


def matched(blocks: ReplicaBlocks) -> int:
    return blocks.matched(PromptKeys(TOKENS), 0.0)


async def test_live_batches_build_the_index_in_order(rig):
    publisher, subscriber, blocks = rig
    for seq in range(3):
        await publisher.send(seq, stored(seq))
    await wait_until_async(lambda: matched(blocks) == 3, timeout=10)
    assert blocks.live(0.0) and subscriber.stats.last_seq == 2
    assert subscriber.stats.events["BlockStored"] == 3 and publisher.replays == []


async def test_a_gap_is_filled_from_the_replay_socket(rig):
    publisher, subscriber, blocks = rig
    await publisher.send(0, stored(0))
    await publisher.send(1, stored(1), live=False)  # missed live
    await publisher.send(2, stored(2))
    await wait_until_async(lambda: matched(blocks) == 3, timeout=10)
    assert publisher.replays == [1] and subscriber.stats.replays["ok"] == 1
    assert subscriber.stats.dropped["gap"] == 1 and not subscriber.stats.cleared


async def test_a_gap_the_replay_cannot_fill_clears_the_index(rig):
    publisher, subscriber, blocks = rig
    await publisher.send(0, stored(0))
    await wait_until_async(lambda: matched(blocks) == 1, timeout=10)
    publisher.kept.clear()  # the engine's buffer no longer holds 1..4
    await publisher.send(5, encode_kv_batch(1.0, [BlockRemoved((999,), "GPU")]))
    await wait_until_async(lambda: subscriber.stats.last_seq == 5, timeout=10)
    assert subscriber.stats.replays["incomplete"] == 1 and subscriber.stats.cleared["gap"] == 1
    assert matched(blocks) == 0  # a removal may have been among what was missed


async def test_numbering_that_starts_again_is_a_restarted_engine(rig):
    publisher, subscriber, blocks = rig
    for seq in range(3):
        await publisher.send(seq, stored(seq))
    await wait_until_async(lambda: matched(blocks) == 3, timeout=10)
    publisher.kept.clear()
    await publisher.send(0, stored(0))
    await wait_until_async(lambda: subscriber.stats.cleared["restart"] == 1, timeout=10)
    assert matched(blocks) == 1 and subscriber.stats.last_seq == 0


async def test_garbage_is_counted_and_the_subscription_goes_on(rig):
    publisher, subscriber, blocks = rig
    await publisher.pub.send_multipart([b"kv", b"short"])
    await publisher.pub.send_multipart([b"kv", b"\x00" * 3, b"x"])
    await publisher.send(0, b"\xc1 not msgpack")
    await publisher.send(1, stored(0))
    await wait_until_async(lambda: matched(blocks) == 1, timeout=10)
    dropped = subscriber.stats.dropped
    assert dropped["malformed message"] == 2 and dropped["malformed batch"] == 1
    assert blocks.live(0.0)


async def test_a_disconnect_stops_routing_on_events_and_a_reconnect_replays(rig):
    publisher, subscriber, blocks = rig
    await publisher.send(0, stored(0))
    await wait_until_async(lambda: matched(blocks) == 1, timeout=10)
    port = publisher.port
    publisher.pub.close(0)  # the engine's publisher goes away
    await wait_until_async(lambda: not blocks.connected, timeout=10)
    assert not blocks.live(0.0)
    publisher.pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    publisher.kept.append((1, stored(1)))  # published while we were away
    publisher.pub.bind(f"tcp://127.0.0.1:{port}")
    await wait_until_async(lambda: blocks.connected and matched(blocks) == 2, timeout=15)
    assert publisher.replays == [1]


async def test_a_gap_the_replay_answers_with_nothing_clears_the_index(rig):
    publisher, subscriber, blocks = rig
    await publisher.send(0, stored(0))
    await wait_until_async(lambda: matched(blocks) == 1, timeout=10)
    await publisher.pub.send_multipart([b"kv", (3).to_bytes(8, "big"), stored(1)])  # 1, 2 lost
    await wait_until_async(lambda: subscriber.stats.last_seq == 3, timeout=10)
    assert publisher.replays == [1] and subscriber.stats.cleared["gap"] == 1
