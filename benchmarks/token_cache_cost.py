"""What the prefix token cache saves per request: a chat's ids with the cache off, warm and cold.

    python -m benchmarks.token_cache_cost [--rounds 5] [--tokens 8192] [--cached 7168]

A chat of ``--tokens`` tokens through the built-in model's chat template: a system prompt of
about ``--cached`` tokens, the same every request (an agent's instructions and tools), then
a user message new every request. Per request, what admission does with precise prefix
routing on: render the chat template, take the prompt's ids (``ModelTokenizer.token_ids``),
key its 16-token blocks (``PromptKeys.keys``). Three ways, side by side in one run:

- ``off``: the cache off (every prompt tokenized whole, as before the cache);
- ``warm``: the cache on, the system prompt's segment cached (the steady state);
- ``cold``: the cache on, every request's system prompt new (a miss each time: the cache's
  own cost on top of tokenizing).

Warmed up, timed in CPU time (``time.process_time_ns``: the tokenizer's threads included);
min / median / max over ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from typing import Any, Callable

from gateway.kvcache.index import PromptKeys
from gateway.sim.model_dir import WORDS, builtin_model_dir
from gateway.tokens import ModelTokenizer


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _sized(tok: ModelTokenizer, tokens: int, rng: random.Random) -> str:
    """Text of about ``tokens`` tokens (the built-in tokenizer: about 1.3 words a token)."""
    text = _words(rng, tokens)
    while len(tok.encode(text, add_special_tokens=False)) > tokens:
        text = text[: int(len(text) * 0.97)]
    return text


def timed(make: Callable[[int], Any], n: int, rounds: int) -> dict[str, float]:
    """CPU µs per call of ``make(i)`` over ``n`` calls a round: the process's CPU time, so
    the tokenizer's own threads (it encodes a batch of segments in parallel) count too."""
    for i in range(3):
        make(-1 - i)
    out = []
    for r in range(rounds):
        gc.collect()
        start = time.process_time_ns()
        for i in range(n):
            make(r * n + i)
        out.append((time.process_time_ns() - start) / 1000 / n)
    return {"min": min(out), "median": statistics.median(out), "max": max(out)}


def run(tokens: int, cached: int, rounds: int, n: int) -> dict[str, Any]:
    rng = random.Random(1)
    off = ModelTokenizer.from_dir(builtin_model_dir())  # its own instance: no cache
    on = ModelTokenizer.from_dir(builtin_model_dir())
    on.enable_cache(64 << 20)
    system = _sized(off, cached, rng)
    # A user message new every request (the rest of the prompt: never cached).
    users = [_sized(off, tokens - cached - 20, random.Random(i))
             for i in range(3 * (rounds * n + 3))]
    # Cold: a new system prompt each request (as long as the warm one, other words).
    colds = [_sized(off, cached, random.Random(1000 + i)) for i in range(rounds * n + 3)]

    def request(tok: ModelTokenizer, system_prompt: str, i: int) -> int:
        messages = [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": users[i % len(users)]}]
        ids = tok.token_ids(tok.render_chat(messages), add_special_tokens=False)
        return len(PromptKeys(ids).keys(16))

    prompt = off.render_chat([{"role": "system", "content": system},
                              {"role": "user", "content": users[0]}])
    # What is timed must be right: the cache's ids are the whole prompt's, warm and cold.
    for text in (prompt, on.render_chat([{"role": "system", "content": colds[-1]}])):
        assert on.token_ids(text, False) == off.token_ids(text, False) == on.token_ids(text, False)
    figures = {
        "prompt_tokens": len(off.encode(prompt, add_special_tokens=False)),
        "cached_tokens": len(off.encode(system, add_special_tokens=False)),
        "off_us": timed(lambda i: request(off, system, i), n, rounds),
        "warm_us": timed(lambda i: request(on, system, i + rounds * n + 3), n, rounds),
        "cold_us": timed(lambda i: request(on, colds[i], i + 2 * (rounds * n + 3)), n, rounds),
        "render_us": timed(lambda i: off.render_chat([{"role": "system", "content": system},
                                                      {"role": "user", "content": users[0]}]),
                           n, rounds),
    }
    figures["warm_over_off"] = figures["warm_us"]["median"] / figures["off_us"]["median"]
    figures["cold_over_off"] = figures["cold_us"]["median"] / figures["off_us"]["median"]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.token_cache_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--cached", type=int, default=7168)
    parser.add_argument("--requests", type=int, default=50, help="requests timed a round")
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args(argv)
    figures = run(args.tokens, args.cached, args.rounds, args.requests)
    fmt = lambda s: f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"  # noqa: E731
    print(f"a chat of {figures['prompt_tokens']:,} tokens, the first "
          f"{figures['cached_tokens']:,} a repeated system prompt; CPU µs per request, "
          f"median (min-max) over {args.rounds} rounds of {args.requests}")
    print(f"render the template alone: {fmt(figures['render_us'])}")
    print(f"render + ids + block keys, cache off:  {fmt(figures['off_us'])}")
    print(f"render + ids + block keys, cache warm: {fmt(figures['warm_us'])}  "
          f"({figures['warm_over_off']:.3f} of off)")
    print(f"render + ids + block keys, cache cold: {fmt(figures['cold_us'])}  "
          f"({figures['cold_over_off']:.3f} of off)")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"args": vars(args), **figures}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
