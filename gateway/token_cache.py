"""The prefix token cache: a prompt's token ids, segment by segment, each segment tokenized once.

A rendered chat prompt is the chat template's special tokens with text between them (the
system prompt, each message, the tool list). A tokenizer (Hugging Face ``tokenizers``) finds
its added tokens in the text first and tokenizes the text between them each on its own, so
the ids of a prompt are the ids of its segments, end to end. A repeated system prompt, tool
list or conversation so far is the same segment again: its ids come from here, and only what
is new is tokenized.

That claim is the library's behaviour, not a law: an added token that strips the whitespace
beside it (``lstrip``/``rstrip``), matches on normalized text or only as a whole word is not
split on (the tokenizer handles it inside its segment), and a pre-tokenizer that treats the
start of the text apart (Metaspace's ``prepend_scheme: first``) breaks it. So the cache checks
the claim on probes when it is made, and is off for a tokenizer that fails them: callers then
tokenize whole prompts, as before. The tokens the post-processor adds (a BOS) are added around
the segments' ids where it only adds a fixed prefix and suffix.

Memory is bounded: an LRU of segments, in bytes (the text and its ids). Thread-safe: long
prompts are counted in worker threads.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Callable, Sequence

from tokenizers import Tokenizer

ENTRY_OVERHEAD = 120  # bytes per entry beyond its text and ids (dict slot, tuple, str header)


def _split_tokens(tokenizer: Tokenizer) -> list[str]:
    """The added tokens the tokenizer matches on the raw text with nothing around them."""
    return [token.content for token in tokenizer.get_added_tokens_decoder().values()
            if token.content and not (token.normalized or token.lstrip or token.rstrip
                                      or token.single_word)]


def _probes(tokens: Sequence[str]) -> list[str]:
    """Texts where segment-wise and whole tokenization would differ if the claim failed:
    tokens at the start, the end, side by side, between spaces, newlines and non-ASCII text."""
    probes = ["plain text without any special token", " leading space", ""]
    for t in list(tokens)[:8]:
        probes += [f"{t}", f"hello{t}world", f"{t} spaced {t}  ", f"{t}\n\nsystem\n{t}{t}x",
                   f"  two{t}\tthree {t}é\u0301 ünï{t}", f"a {t}b{t} c", f"\n{t}\n"]
    return probes


class SegmentTokenCache:
    """Token ids of prompts, from cached segments. ``ids`` returns None where it cannot
    answer exactly (the claim failed on this tokenizer): tokenize the whole text then."""

    def __init__(self, tokenizer: Tokenizer, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hit_tokens = self.miss_tokens = 0  # tokens taken from the cache / tokenized
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        encode_many = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self._encode_many: Callable[[list[str]], list[list[int]]] = \
            lambda texts: [e.ids for e in encode_many(texts, add_special_tokens=False)]
        tokens = _split_tokens(tokenizer)
        self._ids = {t: tokenizer.token_to_id(t) for t in tokens}
        # Longest first: at one position the longest token matches (as the tokenizer's
        # leftmost-longest search does).
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")").split \
            if tokens else None
        self.exact = self._check(tokenizer)
        self._around = self._post_processor(tokenizer) if self.exact else None

    # --- the claim, checked ---

    def _segmented(self, text: str) -> list[int]:
        parts = self._split(text) if self._split is not None else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:  # the split's captured token
                ids.append(self._ids[part])
            elif part:
                ids += self._encode_many([part])[0]
        return ids

    def _check(self, tokenizer: Tokenizer) -> bool:
        return all(self._segmented(probe) == tokenizer.encode(probe, add_special_tokens=False).ids
                   for probe in _probes(list(self._ids)))

    def _post_processor(self, tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
        """What ``add_special_tokens=True`` adds: a fixed prefix and suffix, or None when it is
        not that simple (then such prompts are tokenized whole)."""
        bare = tokenizer.encode("probe text", add_special_tokens=False).ids
        full = tokenizer.encode("probe text", add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                around = full[:start], full[start + len(bare):]
                ok = all(tokenizer.encode(p, add_special_tokens=True).ids
                         == around[0] + self._segmented(p) + around[1] for p in _probes(list(self._ids)))
                return around if ok else None
        return None

    # --- serving ---

    def ids(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """``text``'s ids as ``tokenizer.encode(text, add_special_tokens)`` gives them, or
        None when this cache cannot say exactly."""
        if not self.exact or (add_special_tokens and self._around is None):
            return None
        parts = self._split(text) if self._split is not None else [text]
        found: list[tuple[int, ...] | None] = [None] * len(parts)
        missing: list[int] = []
        entries = self._entries
        with self._lock:
            for i in range(0, len(parts), 2):
                part = parts[i]
                if part:
                    cached = entries.get(part)
                    if cached is None:
                        missing.append(i)
                    else:
                        entries.move_to_end(part)
                        found[i] = cached
        if missing:  # the GIL let go while each is tokenized
            encoded = [self._encode_many([parts[i]])[0] for i in missing]
            with self._lock:
                for i, ids in zip(missing, encoded):
                    found[i] = self._store(parts[i], tuple(ids))
        out: list[int] = list(self._around[0]) if add_special_tokens and self._around else []
        hits = misses = 0
        fresh = set(missing)
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._ids[part])
            elif part:
                segment = found[i]
                assert segment is not None
                out += segment
                if i in fresh:
                    misses += len(segment)
                else:
                    hits += len(segment)
        if add_special_tokens and self._around:
            out += self._around[1]
        with self._lock:
            self.hit_tokens += hits
            self.miss_tokens += misses
        return out

    def _store(self, text: str, ids: tuple[int, ...]) -> tuple[int, ...]:
        size = (len(text) if text.isascii() else 4 * len(text)) + 8 * len(ids) + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return ids  # larger than the whole cache: used, not kept
        entries = self._entries
        if text in entries:
            return entries[text]
        entries[text] = ids
        self.bytes += size
        while self.bytes > self.max_bytes:
            old_text, old_ids = entries.popitem(last=False)
            self.bytes -= ((len(old_text) if old_text.isascii() else 4 * len(old_text))
                           + 8 * len(old_ids) + ENTRY_OVERHEAD)
        return ids

    def __len__(self) -> int:
        return len(self._entries)
