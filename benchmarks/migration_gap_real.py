"""What a migration adds to a stream's gap on real vLLM (the CPU build), against the new
engine's prefill of the continuation.

    PYTHONPATH=. python -m benchmarks.migration_gap_real [--rounds 5] [--prompt-words 600]
                                                       [--break-after 100] [--output 200]

Two vLLM engines serve the tiny random-weight Llama the tests build (``tests/real_engines``),
prefix caching off (so each prefill is a whole one). The first sits behind the tests' cutting
proxy (``tee.Cutter``): after ``--break-after`` chunks it drops the connection, as an engine
that dies does (the gateway sees the reset at once). The gateway continues the stream on the
second engine. The client times every token: the **gap** is from the last token before the
break to the first after it. In the same round (a second later: the engine idle again, as
the continuation found it) the second engine is sent the continuation's
own prompt (the prompt's ids and the tokens so far) directly, streamed, and its TTFT is the
**prefill** the continuation had to pay. Per round: gap, prefill, gap less prefill (what
the gateway added: placement, the request, the splice), and the stream's usual gap between
tokens. Wall-clock on a shared machine: rounds are printed one by one, with their spread.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "real_engines")]

from engines import VllmSpec, vllms  # noqa: E402  (the tests' real engine harness)
from support import gateway_server  # noqa: E402
from tee import Cutter, tee  # noqa: E402
from tiny_model import write_tiny_llama  # noqa: E402

from benchmarks.harness import machine_info  # noqa: E402
from benchmarks.migration_gap import chunk_times  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-words", type=int, default=600)
    parser.add_argument("--break-after", type=int, default=100)
    parser.add_argument("--output", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    words = "the quick brown fox jumps over a lazy dog ".split()
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    with tempfile.TemporaryDirectory(prefix="migration-gap-real-") as scratch:
        model = write_tiny_llama(Path(scratch) / "tiny")
        spec = VllmSpec(("--no-enable-prefix-caching",))
        with vllms(model, spec, spec) as (first, second), tee(first.url, Cutter) as cutter:
            assert isinstance(cutter, Cutter)
            config = {"models": [{"name": "tiny", "replicas": [
                {"url": cutter.url, "engine": "vllm", "name": "cut"},
                {"url": second.url, "engine": "vllm", "name": "other"}]}],
                "balancer": "round_robin", "outlier": {"consecutive_failures": 1000}}
            with gateway_server(Path(scratch), config) as (gateway, _), \
                    httpx.Client(timeout=300) as client:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": args.output,
                        "stream": True, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                prompt_ids = client.post(second.url + "/tokenize", json={
                    "model": "tiny", "prompt": prompt}).json()["tokens"]
                rounds = []
                for _ in range(args.rounds * 4):  # bounded: a round may not start or be cut
                    if len(rounds) == args.rounds:
                        break
                    cuts, cutter.cut_after = cutter.cuts, args.break_after
                    times, counts, ids, replica = chunk_times(client, gateway + "/v1/completions",
                                                              body)
                    if replica != "cut" or cutter.cuts == cuts:  # round robin: the next one
                        cutter.cut_after = None  # starts on the cut one; or fewer chunks came
                        continue                 # (tokens merged) than the cut's count
                    assert len(ids) == args.output, f"{len(ids)} of {args.output} tokens"
                    k = args.break_after  # chunks (vLLM merges tokens when it falls behind)
                    time.sleep(1.0)  # the engine idle again, as the continuation found it
                    sent = time.perf_counter()
                    direct, _, _, _ = chunk_times(client, second.url + "/v1/completions", {
                        **body, "prompt": prompt_ids + ids[:sum(counts[:k])], "max_tokens": 1})
                    gap, prefill = times[k] - times[k - 1], direct[0] - sent
                    usual = sorted(b - a for a, b in zip(times[1:k], times[2:k]))[k // 2 - 1]
                    rounds.append({"gap_s": gap, "prefill_s": prefill, "added_s": gap - prefill,
                                   "usual_itl_s": usual, "prompt_tokens": len(prompt_ids)})
                    print(f"round {len(rounds)}: gap {gap * 1000:.0f} ms, prefill "
                          f"{prefill * 1000:.0f} ms, added {(gap - prefill) * 1000:.1f} ms, "
                          f"usual {usual * 1000:.1f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "rounds": rounds, "machine": machine_info()}, indent=1))


if __name__ == "__main__":
    main()
