"""The simulator's own KV-event encoding (gateway/sim/kv_wire.py), decoded by the gateway
(gateway/engines/vllm.py ``decode_kv_batch``): every event the simulator can publish reads
back as itself, in vLLM 0.32's map encoding and the older positional one. That the bytes are
vLLM's own is tests/real_engines/test_sim_kv_wire.py's check."""

from __future__ import annotations

import random

import msgpack
import pytest

from gateway.engines.vllm import decode_kv_batch
from gateway.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from gateway.sim.kv_wire import encode_batch


def _events(rng: random.Random) -> list[KvEvent]:
    events: list[KvEvent] = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        blocks = rng.randint(1, 4)
        hashes = tuple(rng.randbytes(32) if rng.random() < 0.5 else rng.getrandbits(63)
                       for _ in range(blocks))
        if kind < 0.6:
            size = rng.choice([16, 32])
            lora = rng.choice([None, "sql"])
            extra = rng.choice([None, tuple((lora, "salt") if lora else None
                                           for _ in range(blocks))])
            events.append(BlockStored(hashes, rng.choice([None, rng.getrandbits(63)]),
                                      tuple(rng.randrange(50_000) for _ in range(size * blocks)),
                                      size, lora, extra, rng.choice(["GPU", "CPU", None])))
        elif kind < 0.9:
            events.append(BlockRemoved(hashes, rng.choice(["GPU", None])))
        else:
            events.append(AllBlocksCleared())
    return events


@pytest.mark.parametrize("positional", [False, True])
def test_every_event_the_simulator_publishes_reads_back_as_itself(positional: bool) -> None:
    rng = random.Random(11)
    for _ in range(300):
        events = _events(rng)
        batch = decode_kv_batch(encode_batch(123.5, events, rank=0, positional=positional))
        assert batch.dropped == () and batch.rank == 0 and batch.ts == 123.5
        assert list(batch.events) == events


def test_the_shapes_are_vllms_not_the_gateways() -> None:
    """0.32: events are maps tagged by `type`, fields at their default left out (msgspec's
    omit_defaults: only in maps), the batch an array; the older encoding: arrays, the tag
    first."""
    stored = BlockStored((b"\x01" * 32,), None, tuple(range(16)), 16, None, None, "GPU")
    ts, (event,), rank = msgpack.unpackb(encode_batch(1.0, [stored]), strict_map_key=False)
    assert (ts, rank) == (1.0, 0)
    assert event == {"type": "BlockStored", "block_hashes": [b"\x01" * 32],
                     "parent_block_hash": None, "token_ids": list(range(16)), "block_size": 16,
                     "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
                     "kv_cache_spec_kind": "full_attention"}
    assert msgpack.unpackb(encode_batch(1.0, [stored], rank=None))[2:] == [None]
    (old,) = msgpack.unpackb(encode_batch(1.0, [stored], positional=True))[1]
    assert old == ["BlockStored", [b"\x01" * 32], None, list(range(16)), 16, None, "GPU",
                   None, None]
