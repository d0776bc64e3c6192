"""The simulator's KV events are vLLM's, byte for byte: the same events built with vLLM
0.32's own classes (``vllm.distributed.kv_events``, in the real engine's virtualenv) and
encoded as its ``ZmqEventPublisher`` encodes them equal what the simulator publishes
(gateway/sim/kv_wire.py). No engine runs: vLLM's code does the encoding."""

from __future__ import annotations

import json
import random
import subprocess

from engines import vllm_python
from gateway.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from gateway.sim.kv_wire import encode_batch

VLLM_ENCODER = """
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
out = []
for ts, events in json.load(sys.stdin):
    built = []
    for e in events:
        hashes = [bytes.fromhex(h) if isinstance(h, str) else h for h in e.get("hashes", [])]
        if e["type"] == "BlockStored":
            parent = e["parent"]
            built.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=bytes.fromhex(parent) if isinstance(parent, str) else parent,
                token_ids=e["tokens"], block_size=e["size"], lora_id=None, medium=e["medium"],
                lora_name=e["lora"],
                extra_keys=None if e["extra"] is None else [
                    None if k is None else tuple(k) for k in e["extra"]],
                group_idx=0, kv_cache_spec_kind="full_attention"))
        elif e["type"] == "BlockRemoved":
            built.append(BlockRemoved(block_hashes=hashes, medium=e["medium"]))
        else:
            built.append(AllBlocksCleared())
    # As ZmqEventPublisher: one Encoder, the batch with its data-parallel rank.
    out.append(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=ts, events=built,
                                                             data_parallel_rank=0)).hex())
print(json.dumps(out))
"""


def _events(rng: random.Random) -> list[KvEvent]:
    events: list[KvEvent] = []
    for _ in range(rng.randint(1, 6)):
        kind, blocks = rng.random(), rng.randint(1, 3)
        hashes = tuple(rng.randbytes(32) if rng.random() < 0.5 else rng.getrandbits(62)
                       for _ in range(blocks))
        if kind < 0.6:
            lora = rng.choice([None, "sql"])
            extra = rng.choice([None, tuple((lora, "salt") if lora else ("salt",)
                                           for _ in range(blocks))])
            events.append(BlockStored(hashes, rng.choice([None, rng.getrandbits(62)]),
                                      tuple(rng.randrange(50_000) for _ in range(16 * blocks)),
                                      16, lora, extra, rng.choice(["GPU", "CPU"])))
        elif kind < 0.9:
            events.append(BlockRemoved(hashes, rng.choice(["GPU", None])))
        else:
            events.append(AllBlocksCleared())
    return events


def _as_json(event: KvEvent) -> dict:
    def h(value: object) -> object:
        return value.hex() if isinstance(value, bytes) else value

    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "hashes": [h(x) for x in event.block_hashes],
                "parent": h(event.parent_block_hash), "tokens": list(event.token_ids),
                "size": event.block_size, "medium": event.medium, "lora": event.lora_name,
                "extra": None if event.extra_keys is None else [
                    None if k is None else list(k) for k in event.extra_keys]}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "hashes": [h(x) for x in event.block_hashes],
                "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def test_the_simulators_events_are_vllms_own_bytes() -> None:
    rng = random.Random(5)
    batches = [(float(i) + 0.25, _events(rng)) for i in range(60)]
    done = subprocess.run([str(vllm_python()), "-c", VLLM_ENCODER], capture_output=True,
                          text=True, timeout=300,
                          input=json.dumps([(ts, [_as_json(e) for e in events])
                                            for ts, events in batches]))
    assert done.returncode == 0, done.stderr[-3000:]
    vllms = [bytes.fromhex(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]
    ours = [encode_batch(ts, events, rank=0) for ts, events in batches]
    assert len(vllms) == len(ours)
    assert [i for i, (a, b) in enumerate(zip(ours, vllms)) if a != b] == []
