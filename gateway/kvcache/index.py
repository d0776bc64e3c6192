"""Per replica: the KV blocks its engine holds, as its events announce them.

Blocks are keyed by the gateway's own hash, not the engine's: a block's key is a hash of its
parent's key, its token ids and its extra keys (LoRA adapter, ``cache_salt``), chained from
the first block as the engine chains its own. The engine's hashes depend on its version, its
hash algorithm and, for the first block, a seed that is random unless the engine pins
``PYTHONHASHSEED``; the token ids every ``BlockStored`` carries do not. So each engine hash
maps to a key (``BlockRemoved`` names engine hashes), and a prompt is keyed from the token ids
admission already has (``PromptKeys``): equal keys, equal prefix, whatever the engine is.

Memory is bounded per replica: at most ``capacity`` blocks (the engine's own block count,
once its /metrics says it; a block past that means a removal was missed: the oldest goes).

For a while after a request is sent, its blocks count as held (``note_sent``): the engine has
not announced them yet, and the next request with the same prefix should follow the first.
The same notes tell when a replica's events stopped: blocks were sent that the engine should
have announced, and no event came for ``stale_after`` seconds.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Callable, KeysView, Sequence

from gateway.kvcache.events import (AllBlocksCleared, BlockHash, BlockRemoved, BlockStored,
                                    EventBatch, ExtraKeys)

ROOT = 0  # the parent key of a prompt's first block
MAX_PROMPT_TOKENS = 32768  # a prompt is keyed up to here (hashing is ~0.3 µs a token)
DEFAULT_CAPACITY = 1 << 20  # blocks per replica until the engine reports its own count
CHURN_HALF_LIFE = 10.0  # seconds: how long a block stored counts in a replica's churn


def extra_keys(lora: str | None, salt: str | None, first: bool) -> ExtraKeys:
    """A text block's extra keys as vLLM makes them (``generate_block_hash_extra_keys``):
    the adapter's name on every block, the cache salt on the first."""
    keys = ([lora] if lora else []) + ([salt] if first and salt else [])
    return tuple(keys) if keys else None


def block_key(parent: int, tokens: Sequence[int], extra: ExtraKeys) -> int:
    return hash((parent, tuple(tokens), extra))


class PromptKeys:
    """One prompt's token ids, cut into blocks and keyed as the index keys blocks (once per
    block size: every replica of a model usually has the same)."""

    __slots__ = ("ids", "lora", "salt", "_keys")

    def __init__(self, ids: Sequence[int], lora: str | None = None,
                 salt: str | None = None) -> None:
        self.ids = ids
        self.lora = lora
        self.salt = salt
        self._keys: dict[int, tuple[int, ...]] = {}

    def keys(self, block_size: int) -> tuple[int, ...]:
        keys = self._keys.get(block_size)
        if keys is None:
            ids, out, parent = self.ids, [], ROOT
            full = min(len(ids), MAX_PROMPT_TOKENS) // block_size * block_size
            for start in range(0, full, block_size):
                parent = block_key(parent, ids[start:start + block_size],
                                   extra_keys(self.lora, self.salt, start == 0))
                out.append(parent)
            keys = self._keys[block_size] = tuple(out)
        return keys

    def __len__(self) -> int:
        return len(self.ids)


class _Block:
    __slots__ = ("key", "media")

    def __init__(self, key: int) -> None:
        self.key = key
        self.media: set[str | None] = set()


class ReplicaBlocks:
    """What one replica's engine holds, fed by its events (``apply``) and read by the
    balancer (``live``, ``matched``, ``note_sent``)."""

    def __init__(self, pending_seconds: float = 2.0, stale_after: float = 5.0,
                 capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pending_seconds = pending_seconds
        self.stale_after = stale_after
        self.capacity = capacity
        self.clock = clock
        # The engine's: from its /metrics (vLLM's cache_config_info), or its first BlockStored.
        self.block_size: int | None = None
        self.connected = False  # the subscription is up (set by the subscriber)
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()  # engine hash -> block
        self._held: Counter[int] = Counter()  # key -> engine blocks holding it
        self._pending: OrderedDict[int, float] = OrderedDict()  # key sent -> until when
        self._awaited_since: float | None = None  # blocks sent, no event since
        self.overflowed = 0  # blocks dropped past capacity (a missed removal)
        self.orphans = 0  # stored blocks whose parent was unknown (not keyable)
        self.predicted_tokens = 0  # prompt tokens the index said were cached where sent
        self.queried_tokens = 0  # prompt tokens of the requests sent
        self._churned = 0.0  # blocks newly stored, decayed with CHURN_HALF_LIFE ...
        self._churned_at = 0.0  # ... as of then

    # --- fed by the subscriber ---

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(h, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        self._awaited_since = None

    def clear(self) -> None:
        """Forget every block (AllBlocksCleared, the engine restarted or went away)."""
        self._blocks.clear()
        self._held.clear()
        self._pending.clear()
        self._awaited_since = None

    def _stored(self, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:  # its chain began before we listened, or was lost
                self.orphans += len(event.block_hashes)
                return
            parent = known.key
        size = self.block_size = event.block_size
        tokens, extra = event.token_ids, event.extra_keys
        for i, h in enumerate(event.block_hashes):
            first = i == 0 and event.parent_block_hash is None
            keys = extra[i] if extra is not None else extra_keys(event.lora_name, None, first)
            parent = block_key(parent, tokens[i * size:(i + 1) * size], keys)
            block = self._blocks.get(h)
            if block is None:
                block = self._blocks[h] = _Block(parent)
                self._held[parent] += 1
                self._note_stored(1)
            else:
                self._blocks.move_to_end(h)
            block.media.add(event.medium)
        while len(self._blocks) > self.capacity:
            h, _ = next(iter(self._blocks.items()))
            self._remove(h, None)
            self.overflowed += 1

    def _remove(self, h: BlockHash, medium: str | None) -> None:
        block = self._blocks.get(h)
        if block is None:
            return  # stored before we listened
        if medium is not None and len(block.media) > 1:
            block.media.discard(medium)  # still held in another tier (CPU offload)
            return
        del self._blocks[h]
        left = self._held[block.key] - 1
        if left:
            self._held[block.key] = left
        else:
            del self._held[block.key]

    # --- read by the balancer ---

    def live(self, now: float) -> bool:
        """Worth routing on: subscribed, the block size known, and no blocks sent that the
        engine should have announced by now."""
        return (self.connected and self.block_size is not None
                and (self._awaited_since is None or now - self._awaited_since <= self.stale_after))

    def matched(self, prompt: PromptKeys, now: float) -> int:
        """How many leading blocks of ``prompt`` the engine holds (or was just sent)."""
        held, pending, n = self._held, self._pending, 0
        for key in prompt.keys(self.block_size or 1):
            if key not in held and pending.get(key, 0.0) <= now:
                break
            n += 1
        return n

    def note_sent(self, prompt: PromptKeys, matched_blocks: int, now: float) -> None:
        """``prompt`` was sent here, ``matched_blocks`` of it predicted cached: its other
        blocks count as held for ``pending_seconds``, and an event is awaited for them."""
        size = self.block_size or 1
        keys = prompt.keys(size)
        self.predicted_tokens += matched_blocks * size
        self.queried_tokens += len(prompt)
        pending = self._pending_at(now)
        until = now + self.pending_seconds
        new = False
        for key in keys[matched_blocks:]:
            if key not in self._held:
                pending[key] = until
                pending.move_to_end(key)
                new = True
        if new and self._awaited_since is None:
            self._awaited_since = now

    def _pending_at(self, now: float) -> OrderedDict[int, float]:
        """The blocks sent and not yet expired (kept in expiry order: drop from the front)."""
        pending = self._pending
        while pending and next(iter(pending.values())) <= now:
            pending.popitem(last=False)
        return pending

    def size(self) -> int:
        return len(self._blocks)

    def keys(self) -> KeysView[int]:
        """The keys of the blocks it holds (a view: what another replica may hold too)."""
        return self._held.keys()

    # --- churn: how fast the engine's cache turns over ---

    def _note_stored(self, blocks: float) -> None:
        now = self.clock()
        self._churned = self._decayed(now) + blocks
        self._churned_at = now

    def _decayed(self, now: float) -> float:
        return self._churned * 0.5 ** (max(0.0, now - self._churned_at) / CHURN_HALF_LIFE)

    def churn(self, now: float) -> float:
        """Blocks stored lately (the last ``CHURN_HALF_LIFE`` seconds, decaying, and those
        just sent), as a share of the engine's blocks: near 0, new blocks land in room to
        spare; 1 or more, each one evicts a block stored moments ago (a cache too small for
        what is sent there)."""
        return (self._decayed(now) + len(self._pending_at(now))) / max(1, self.capacity)
