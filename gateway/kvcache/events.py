"""KV-cache events as the gateway keeps them, whichever engine wire they came in on.

An engine with prefix caching announces each block of KV it caches (``BlockStored``: the
blocks' hashes, their parent's hash, their token ids), each block it evicts
(``BlockRemoved``) and a reset (``AllBlocksCleared``). Block hashes are the engine's own and
opaque here (an int or bytes): the index keys blocks by a hash of its own over the token ids
(``gateway/kvcache/index.py``). The wire codec is the engine's (``gateway/engines/vllm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

BlockHash = Union[int, bytes]
# What else keys a block besides its tokens, as vLLM's ``extra_keys`` has it per block: the
# LoRA adapter's name, multimodal hashes, the request's ``cache_salt`` (first block only).
ExtraKeys = Union[tuple[Any, ...], None]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]  # every block's tokens, in order
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None  # one per block; None: not reported
    medium: str | None = None  # GPU, CPU, ... (None: the engine does not say)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch (one engine step's events), as decoded: what could be read, and
    a reason for each event that could not (counted and dropped, never fatal)."""

    ts: float  # the engine's wall-clock time when it published the batch
    events: tuple[KvEvent, ...]
    rank: int | None = None  # data-parallel rank
    dropped: tuple[str, ...] = ()


class MalformedBatch(ValueError):
    """A payload that is not a batch at all (the whole message is dropped)."""
