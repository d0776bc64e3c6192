"""Deterministic generated text: one generated token = one word piece (`" word"`).

Pieces come from ``gateway.sim.model_dir.WORDS``; their JSON-escaped bytes are computed once so
rendering a token into an SSE event is a byte concatenation, not a JSON dump.
"""

from __future__ import annotations

import random
from array import array
import zlib
from typing import Sequence

import orjson

from gateway.sim.model_dir import WORDS

PIECES: tuple[str, ...] = tuple(" " + w for w in WORDS)
PIECES_JSON: tuple[bytes, ...] = tuple(orjson.dumps(p) for p in PIECES) + (b'""',)  # b'" the"'; EOS
_INDICES = range(len(PIECES))


def default_seed(prompt_ids: Sequence[int]) -> int:
    """A seed derived from the prompt, stable across processes (unlike ``hash()``); also the
    state ``generate`` starts from (the crc32 of the context's token ids)."""
    return zlib.crc32(array("q", prompt_ids).tobytes())


def id_bytes(piece_ids: Sequence[int]) -> tuple[bytes, ...]:
    """Each piece's token id as ``default_seed`` folds it into the context's state."""
    return tuple(array("q", [i]).tobytes() for i in piece_ids)


DEFAULT_ID_BYTES = id_bytes(_INDICES)  # a piece's index as its id (no tokenizer at hand)


def generate(state: int, n: int, salt: int = 0,
             piece_bytes: Sequence[bytes] = DEFAULT_ID_BYTES) -> tuple[list[int], list[int]]:
    """Indices into ``PIECES`` of ``n`` generated tokens, each drawn from the whole context
    before it, as a model's are: ``state`` is the crc32 of the context's token ids
    (``default_seed`` of the prompt), and each token drawn is folded into it (its id's
    bytes, ``piece_bytes``). So a prompt that ends with the tokens drawn so far goes on
    exactly as the first generation did: what continuing a stream on another replica
    relies on. ``salt``: a client's sampling seed, the choice's index, another text.
    Returns the tokens and the context's state before each and after the last (what a
    token's logprobs are drawn from, so they too go on alike)."""
    out, states = [], [state]
    crc, pieces = zlib.crc32, len(PIECES)
    for _ in range(n):
        j = ((state ^ salt) * 0x9E3779B1 >> 16) % pieces
        out.append(j)
        state = crc(piece_bytes[j], state)
        states.append(state)
    return out, states


def natural_length(seed: int, mean: int, cap: int) -> int:
    """Output length when the request leaves it open: uniform around ``mean``, within ``cap``."""
    low, high = max(1, mean // 2), max(1, mean + mean // 2)
    return max(1, min(cap, random.Random(seed ^ 0x5EED).randint(low, high)))


def text(pieces: Sequence[int]) -> str:
    return "".join([PIECES[i] for i in pieces if i != EOS])


class PieceIds:
    """Token id of each piece in a given tokenizer (first id when a piece spans several)."""

    def __init__(self, encode) -> None:  # encode: (str) -> list[int]
        self.ids = tuple((encode(p) or [0])[0] for p in PIECES)


# A natural end of generation is an end-of-sequence token, as on a real engine: generated and
# counted like any token, empty in OpenAI texts, the tokenizer's EOS (special) in TGI's details.
EOS = len(PIECES)


def words(pieces: Sequence[int]) -> list[int]:
    return [i for i in pieces if i != EOS]


def logprob(seed: int, position: int) -> float:
    """The deterministic logprob of the token at ``position`` (sampled tokens rank first);
    a generated token's ``seed`` is its context (``Choice.context``), its position 0."""
    return -round(0.05 + (zlib.crc32(b"%d:%d" % (seed, position)) % 3000) / 1000, 4)


def alternatives(seed: int, position: int, sampled: int, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens at ``position``: the sampled one first, then other pieces,
    each less likely than the one before."""
    first = logprob(seed, position)
    out = [(sampled, first)]
    step = 1 + (zlib.crc32(b"alt:%d:%d" % (seed, position)) % 7)
    j = sampled if sampled != EOS else 0
    while len(out) < n:
        j = (j + step) % len(PIECES)
        if all(j != k for k, _ in out):
            out.append((j, round(first - 0.5 * len(out), 4)))
    return out


def stop_at(pieces: Sequence[int], stops: Sequence[str], suffix_rule: bool) -> tuple[int, str] | None:
    """The first token after which a stop string matched, and which: TGI's rule
    (``suffix_rule``: the text ends with it) or vLLM's, SGLang's and llama.cpp's (it
    appears in the text)."""
    if not stops:
        return None
    text = ""
    for k, j in enumerate(pieces):
        if j == EOS:
            return None
        text += PIECES[j]
        for stop in stops:
            if (text.endswith(stop) if suffix_rule else stop in text):
                return k, stop
    return None
