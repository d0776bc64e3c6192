"""The simulated engine's own encoding of KV-cache events, written from vLLM's definitions and
not with the gateway's code: a misreading of vLLM's wire in the gateway's decoder
(``gateway.engines.vllm.decode_kv_batch``) must not pass every simulated test because the
simulator made the same mistake.

The structs below are vLLM 0.32's (``vllm/distributed/kv_events.py``), field for field and
with its msgspec options, and msgspec encodes them as vLLM's ``ZmqEventPublisher`` does
(``msgspec.msgpack.Encoder``): the batch an array ``[ts, events, data_parallel_rank]``, each
event a map tagged by its class name, fields equal to their default left out. vLLM before
0.32 published each event as an array (``array_like``): ``positional``. What a block-storing
engine step fills in is what the real engine was seen to send: ``group_idx`` 0 and
``kv_cache_spec_kind`` ``"full_attention"`` (one full-attention KV group).
tests/real_engines/test_sim_kv_wire.py checks the bytes against vLLM's own classes.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from gateway.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Union[int, None] = None


class _Stored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Union[ExternalBlockHash, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None
    session_id: Union[str, None] = None


class _Removed(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: Union[str, None]
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None


class _Cleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


# vLLM before 0.32: each event an array, its tag first (array_like=True, tag=True).
class _StoredArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Union[ExternalBlockHash, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None] = None
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None


class _RemovedArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                    tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: Union[str, None]


class _ClearedArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                    tag="AllBlocksCleared"):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def _struct(event: KvEvent, positional: bool) -> msgspec.Struct:
    if isinstance(event, BlockStored):
        extra = None if event.extra_keys is None else list(event.extra_keys)
        fields = dict(block_hashes=list(event.block_hashes),
                      parent_block_hash=event.parent_block_hash, token_ids=list(event.token_ids),
                      block_size=event.block_size, lora_id=None, medium=event.medium,
                      lora_name=event.lora_name, extra_keys=extra)
        if positional:
            return _StoredArray(**fields)
        return _Stored(**fields, group_idx=0, kv_cache_spec_kind="full_attention")
    if isinstance(event, BlockRemoved):
        cls = _RemovedArray if positional else _Removed
        return cls(block_hashes=list(event.block_hashes), medium=event.medium)
    assert isinstance(event, AllBlocksCleared)
    return _ClearedArray() if positional else _Cleared()


def encode_batch(ts: float, events: list[KvEvent], rank: int | None = 0,
                 positional: bool = False) -> bytes:
    """One published payload, as vLLM's publisher encodes it."""
    return _ENCODER.encode(EventBatch(ts, [_struct(e, positional) for e in events], rank))
