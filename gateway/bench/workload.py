"""What to send: prompt and output lengths (fixed or from a distribution), synthetic prompts
of a given token length, and JSONL datasets.

Synthetic prompts are seeded random sequences of common English words, each written as
``" word"``: one token per word in the simulated engines' tokenizer and in most BPE
vocabularies (Llama-3, GPT), so a prompt of N words is about N tokens on a real model too.
Distinct words per request mean no two prompts share a prefix (no accidental prefix-cache hits).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from gateway.bench.loadgen import Request
from gateway.sim.model_dir import WORDS

_PIECES = tuple(" " + w for w in WORDS)


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: ``N`` (fixed), ``uniform:LO:HI``, ``normal:MEAN:SD``,
    ``exp:MEAN`` (exponential). Samples are whole numbers of at least 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "Lengths":
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1:
                value = int(parts[0])
                if value < 1:
                    raise ValueError
                return cls("fixed", value)
            kind, *nums = parts
            values = [float(n) for n in nums]
        except ValueError:
            raise ValueError(f"bad length {spec!r}: use N, uniform:LO:HI, normal:MEAN:SD "
                             "or exp:MEAN (tokens, N >= 1)") from None
        if kind == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1]:
            return cls(kind, *values)
        if kind == "normal" and len(values) == 2 and values[0] >= 1 and values[1] >= 0:
            return cls(kind, *values)
        if kind == "exp" and len(values) == 1 and values[0] >= 1:
            return cls(kind, values[0])
        raise ValueError(f"bad length {spec!r}: use N, uniform:LO:HI (1 <= LO <= HI), "
                         "normal:MEAN:SD or exp:MEAN")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.a, self.b)))
        return max(1, round(rng.expovariate(1.0 / self.a)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "exp":
            return f"exp:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def synthetic_prompt(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of random common words (exactly that many in the sim's tokenizer)."""
    return "".join(rng.choices(_PIECES, k=tokens))


def synthetic_requests(n: int, prompt_tokens: Lengths, output_tokens: Lengths,
                       seed: int = 0, tag: str = "") -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = prompt_tokens.sample(rng)
        out.append(Request(prompt=synthetic_prompt(prompt, rng),
                           max_tokens=output_tokens.sample(rng), tag=tag))
    return out


def load_dataset(path: str | Path, output_tokens: Lengths, seed: int = 0,
                 limit: int | None = None) -> list[Request]:
    """One request per JSONL line: ``{"prompt": "..."}`` or ``{"messages": [...]}`` (or TGI's
    ``{"inputs": "..."}``), with optional ``max_tokens`` (or ``output_tokens`` /
    ``max_new_tokens``; else drawn from ``output_tokens``) and optional ``tag``."""
    rng = random.Random(seed)
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: each line must be a JSON object")
            prompt = row.get("prompt", row.get("inputs"))
            messages = row.get("messages")
            if messages is not None:
                if not (isinstance(messages, list) and messages
                        and all(isinstance(m, dict) and "content" in m for m in messages)):
                    raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                                     "{role, content} objects")
            elif not isinstance(prompt, str):
                raise ValueError(f"{where}: needs a string 'prompt' (or 'inputs') or 'messages'")
            max_tokens = next((row[k] for k in ("max_tokens", "output_tokens", "max_new_tokens")
                               if k in row), None)
            if max_tokens is None:
                max_tokens = output_tokens.sample(rng)
            elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{where}: max_tokens must be a positive integer")
            out.append(Request(prompt=prompt or "", max_tokens=max_tokens, messages=messages,
                               tag=str(row.get("tag", ""))))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out
