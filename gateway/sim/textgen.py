"""Deterministic generated text: one generated token = one word piece (`" word"`).

Pieces come from ``gateway.model_dir.WORDS``; their JSON-escaped bytes are computed once so
rendering a token into an SSE event is a byte concatenation, not a JSON dump.
"""

from __future__ import annotations

import random
from array import array
import zlib
from typing import Sequence

import orjson

from gateway.model_dir import WORDS

PIECES: tuple[str, ...] = tuple(" " + w for w in WORDS)
PIECES_JSON: tuple[bytes, ...] = tuple(orjson.dumps(p) for p in PIECES)  # b'" the"'
_INDICES = range(len(PIECES))


def default_seed(prompt_ids: Sequence[int]) -> int:
    """A seed derived from the prompt, stable across processes (unlike ``hash()``)."""
    return zlib.crc32(array("q", prompt_ids).tobytes())


def generate(seed: int, n: int) -> list[int]:
    """Indices into ``PIECES`` of ``n`` generated tokens."""
    return random.Random(seed).choices(_INDICES, k=n)


def natural_length(seed: int, mean: int, cap: int) -> int:
    """Output length when the request leaves it open: uniform around ``mean``, within ``cap``."""
    low, high = max(1, mean // 2), max(1, mean + mean // 2)
    return max(1, min(cap, random.Random(seed ^ 0x5EED).randint(low, high)))


def text(pieces: Sequence[int]) -> str:
    return "".join([PIECES[i] for i in pieces])


class PieceIds:
    """Token id of each piece in a given tokenizer (first id when a piece spans several)."""

    def __init__(self, encode) -> None:  # encode: (str) -> list[int]
        self.ids = tuple((encode(p) or [0])[0] for p in PIECES)
