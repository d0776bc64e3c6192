"""Which prompt prefixes each replica has recently served: hashed byte blocks, LRU, bounded.

A prompt is cut into fixed-size byte blocks and each block's hash is chained to the one
before it, so equal hashes at position i mean equal prompts up to the end of block i (the
engines' own prefix caches work on the same principle, on token blocks). Per replica the
index keeps the most recently placed blocks in an LRU of a fixed number of entries, so memory
is bounded whatever the traffic (an unbounded prefix tree is a known out-of-memory bug in a
peer router). Hashing is cheap and bounded too: at most ``max_blocks`` blocks of a prompt.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

BLOCK_BYTES = 256      # ~64 tokens: fine enough for system prompts and conversation turns
MAX_PROMPT_BLOCKS = 256  # hash at most the first 64 KiB of a prompt
TOKENS_PER_BLOCK = BLOCK_BYTES // 4  # at window.ESTIMATED_BYTES_PER_TOKEN (for sizing only)


def prompt_blocks(text: str | bytes, block_bytes: int = BLOCK_BYTES,
                  max_blocks: int = MAX_PROMPT_BLOCKS) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``text`` (at most ``max_blocks`` of them)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    full = min(len(data) // block_bytes, max_blocks)
    out, parent = [], 0
    for start in range(0, full * block_bytes, block_bytes):
        parent = hash((parent, data[start:start + block_bytes]))
        out.append(parent)
    return tuple(out)


def token_blocks(ids: list[int], block_bytes: int = BLOCK_BYTES,
                 max_blocks: int = MAX_PROMPT_BLOCKS) -> tuple[int, ...]:
    """The same for a prompt given as token ids (8 bytes per id)."""
    try:
        data = array("q", ids[:block_bytes * max_blocks // 8]).tobytes()
    except (OverflowError, TypeError):
        return ()  # not plain token ids: no affinity for this prompt
    return prompt_blocks(data, block_bytes, max_blocks)


class PrefixIndex:
    """Per replica: the last ``capacity_blocks`` distinct prompt blocks placed there."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def matched_blocks(self, replica: str, blocks: tuple[int, ...]) -> int:
        """How many leading blocks of a prompt ``replica`` holds (read-only).

        ``record`` stores a prompt tail first, so its head is always more recent than its
        tail and eviction eats prompts from the end, as the engines' caches do: what a
        replica holds of a prompt is a leading run of its blocks, found by bisection."""
        seen = self._blocks.get(replica)
        if not seen or not blocks or blocks[0] not in seen:
            return 0
        held, unknown = 1, len(blocks)  # blocks[:held] are held; the answer is <= unknown
        while held < unknown:
            mid = (held + unknown + 1) // 2
            if blocks[mid - 1] in seen:
                held = mid
            else:
                unknown = mid - 1
        return held

    def record(self, replica: str, blocks: tuple[int, ...]) -> None:
        """``replica`` now holds these blocks; evict the least recently placed beyond cap."""
        seen = self._blocks.get(replica)
        if seen is None:
            seen = self._blocks[replica] = OrderedDict()
        for block in reversed(blocks):  # tail first: the head ends up most recent
            if block in seen:
                seen.move_to_end(block)
            else:
                seen[block] = None
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop what is known of a replica (removed, or restarted with an empty cache)."""
        self._blocks.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
