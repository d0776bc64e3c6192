"""What precise prefix routing (KV-cache events) costs in CPU, per event and per request.

    python -m benchmarks.kv_events_cost [--rounds 5] [--batches 20000] [--out F.json]

1. Per event, on the subscriber's path: ``decode_kv_batch`` and ``ReplicaBlocks.apply`` on
   batches as a busy vLLM publishes them (BlockStored of 1-16 blocks of 16 or 32 tokens,
   chained on earlier blocks, 32-byte hashes as vLLM's sha256; as many BlockRemoved events
   and removed blocks as stored ones, the index at steady state), then the whole path: a
   ZMQ publisher in another process (pinned to the other core) -> ``EventSubscriber`` on
   loopback, its process's CPU (ZMQ's I/O thread included) per event.
2. Per request, on admission and placement: a chat request of 256, 2,048 and 8,192 tokens
   through the built-in model's chat template: tokenizing it (``ModelTokenizer.encode``, what
   admission does for every request when events are on) against the one-token-per-byte bound
   it checked before; ``PromptKeys.keys`` for block sizes 16 and 32; ``matched`` on 8
   replicas of 60,000 blocks each; ``note_sent``.

Single-threaded (the measuring process on one core), warmed up, timed with
``time.perf_counter_ns``; every figure is min / median / max over ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gateway.engines.vllm import decode_kv_batch, encode_kv_batch
from gateway.kvcache.events import BlockRemoved, BlockStored, EventBatch
from gateway.kvcache.index import PromptKeys, ReplicaBlocks
from gateway.sim.model_dir import WORDS, builtin_model_dir
from gateway.tokens import ModelTokenizer

# The gateway's CPU per non-streamed request (docs/performance.md, 2026-11-26/25): under wrk
# on a quiet VM ("Per request, and at saturation": 173-176 µs), and at c=64 on the fastest VM
# (the table against vllm-router: 89.1, 90.9 µs).
REQUEST_CPU_US = {"wrk, quiet VM, performance.md's per-request section": 173.0,
                  "c=64, fastest VM, performance.md's table against vllm-router": 90.0}
PROMPT_TOKENS = (256, 2048, 8192)
REPLICAS = 8
INDEX_BLOCKS = 60_000


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


# --- 1. events -------------------------------------------------------------------------------

class Engine:
    """A busy engine's stream of event batches: chains stored on earlier blocks, the oldest
    blocks removed as many as were stored once ``capacity`` is reached."""

    def __init__(self, block_size: int, capacity: int, seed: int) -> None:
        self.size, self.capacity = block_size, capacity
        self.rng = random.Random(seed)
        self.live: dict[bytes, None] = {}  # insertion order: oldest first
        self.recent: list[bytes] = []
        self.n = 0

    def _hash(self) -> bytes:
        self.n += 1
        return self.n.to_bytes(8, "big") + self.rng.randbytes(24)

    def batch(self, ts: float) -> list[Any]:
        rng, events, stored = self.rng, [], 0
        for _ in range(rng.randint(1, 3)):
            blocks = rng.randint(1, 16)
            parent = rng.choice(self.recent[-64:]) if self.recent and rng.random() < 0.7 else None
            if parent is not None and parent not in self.live:
                parent = None
            hashes = tuple(self._hash() for _ in range(blocks))
            tokens = tuple(rng.randrange(128_000) for _ in range(blocks * self.size))
            events.append(BlockStored(hashes, parent, tokens, self.size, medium="GPU"))
            for h in hashes:
                self.live[h] = None
            self.recent.extend(hashes)
            del self.recent[:-256]
            stored += blocks
        over = len(self.live) - self.capacity
        if over > 0:
            it = iter(self.live)
            old = [next(it) for _ in range(over)]
            for h in old:
                del self.live[h]
            parts = len(events)
            for i in range(parts):
                chunk = tuple(old[i * len(old) // parts:(i + 1) * len(old) // parts])
                if chunk:
                    events.append(BlockRemoved(chunk, medium="GPU"))
        return events


def event_stream(block_size: int, warm: int, timed: int, seed: int = 1
                 ) -> tuple[list[bytes], list[bytes]]:
    """Payloads to fill an index to steady state, then the ones to time."""
    engine = Engine(block_size, INDEX_BLOCKS, seed)
    fill = []
    while len(engine.live) < INDEX_BLOCKS:
        fill.append(encode_kv_batch(time.time(), engine.batch(0.0)))
    fill += [encode_kv_batch(time.time(), engine.batch(0.0)) for _ in range(warm)]
    return fill, [encode_kv_batch(time.time(), engine.batch(0.0)) for _ in range(timed)]


def filled(fill: list[bytes]) -> ReplicaBlocks:
    blocks = ReplicaBlocks()
    for payload in fill:
        blocks.apply(decode_kv_batch(payload))
    return blocks


def bench_events(block_size: int, batches: int, rounds: int) -> dict[str, Any]:
    fill, timed = event_stream(block_size, warm=2000, timed=batches)
    decoded = [decode_kv_batch(p) for p in timed]
    events = sum(len(b.events) for b in decoded)
    stored = [e for b in decoded for e in b.events if isinstance(e, BlockStored)]
    removed = [e for b in decoded for e in b.events if isinstance(e, BlockRemoved)]
    dec, app, both = [], [], []
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter_ns()
        for p in timed:
            decode_kv_batch(p)
        dec.append((time.perf_counter_ns() - t0) / 1000)
        blocks = filled(fill)
        gc.collect()
        t0 = time.perf_counter_ns()
        for b in decoded:
            blocks.apply(b)
        app.append((time.perf_counter_ns() - t0) / 1000)
        blocks = filled(fill)
        gc.collect()
        t0 = time.perf_counter_ns()
        for p in timed:
            blocks.apply(decode_kv_batch(p))
        both.append((time.perf_counter_ns() - t0) / 1000)
    assert blocks.orphans < events  # chains hold
    return {
        "block_size": block_size, "batches": batches, "events": events,
        "stored_events": len(stored), "stored_blocks": sum(len(e.block_hashes) for e in stored),
        "removed_events": len(removed),
        "removed_blocks": sum(len(e.block_hashes) for e in removed),
        "payload_bytes_per_batch": sum(map(len, timed)) / batches,
        "index_blocks": blocks.size(), "orphans": blocks.orphans,
        "decode_us_per_event": spread([t / events for t in dec]),
        "apply_us_per_event": spread([t / events for t in app]),
        "decode_apply_us_per_event": spread([t / events for t in both]),
        "decode_apply_us_per_batch": spread([t / batches for t in both]),
        "decode_apply_events_per_core_s": spread([events / t * 1e6 for t in both]),
    }


def _publish(endpoint: str, topic: bytes, payloads: list[bytes], core: int | None) -> None:
    import zmq
    if core is not None:
        os.sched_setaffinity(0, {core})
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that sees the subscription arrive
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    pub.recv()  # the subscription
    time.sleep(0.05)
    for seq, payload in enumerate(payloads):
        pub.send_multipart([topic, seq.to_bytes(8, "big", signed=True), payload], copy=False)
    pub.close(linger=-1)  # until the subscriber has taken every batch
    ctx.term()


async def _subscribe(endpoint: str, blocks: ReplicaBlocks, n: int) -> tuple[float, float, Any]:
    import zmq.asyncio
    from gateway.kvcache.subscriber import EventSubscriber
    ctx = zmq.asyncio.Context()
    sub = EventSubscriber("r0", endpoint, None, "kv", decode_kv_batch, blocks, ctx)
    task = asyncio.create_task(sub.run())
    while sub.stats.last_seq is None:
        await asyncio.sleep(0.0005)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    deadline = time.monotonic() + 300
    while sub.stats.last_seq < n - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the subscriber stopped at batch {sub.stats.last_seq} of {n}")
        await asyncio.sleep(0.001)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    ctx.term()
    return cpu, wall, sub.stats


def bench_zmq(block_size: int, batches: int, rounds: int, cores: tuple[int, int] | None
              ) -> dict[str, Any]:
    """The whole path; the first batch starts the clock (it and the rest are counted)."""
    from benchmarks.harness import free_port
    fill, timed = event_stream(block_size, warm=2000, timed=batches, seed=2)
    events = sum(len(decode_kv_batch(p).events) for p in timed[1:])
    cpu_us, wall_s = [], []
    mp = multiprocessing.get_context("spawn")
    for _ in range(rounds):
        blocks = filled(fill)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub = mp.Process(target=_publish, args=(endpoint, b"kv", timed,
                                                 cores[1] if cores else None))
        pub.start()
        gc.collect()
        cpu, wall, stats = asyncio.run(_subscribe(endpoint, blocks, batches))
        pub.join(10)
        if pub.is_alive():
            pub.terminate()
        assert not stats.dropped and not stats.cleared, (stats.dropped, stats.cleared)
        cpu_us.append(cpu * 1e6)
        wall_s.append(wall)
    return {"block_size": block_size, "batches": batches - 1, "events": events,
            "cpu_us_per_event": spread([c / events for c in cpu_us]),
            "events_per_core_s": spread([events / c * 1e6 for c in cpu_us]),
            "events_per_wall_s": spread([events / w for w in wall_s])}


# --- 2. requests -----------------------------------------------------------------------------

def per_call_us(fn: Callable[[], Any], n: int, rounds: int) -> dict[str, float]:
    for _ in range(max(3, n // 10)):
        fn()
    out = []
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / 1000 / n)
    return spread(out)


def chat_text(tok: ModelTokenizer, tokens: int, seed: int) -> str:
    """A one-message chat prompt whose rendering encodes to ``tokens`` tokens (near enough)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens * 2)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt stays within ``tokens``
        mid = (lo + hi + 1) // 2
        text = tok.render_chat([{"role": "user", "content": " ".join(words[:mid])}])
        if len(tok.encode(text, add_special_tokens=False)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return tok.render_chat([{"role": "user", "content": " ".join(words[:lo])}])


def index_holding(prompt: PromptKeys, fraction: float, seed: int) -> ReplicaBlocks:
    """A replica whose engine holds ``INDEX_BLOCKS`` blocks, ``fraction`` of them the
    prompt's leading blocks (stored as its engine would)."""
    size, rng = 16, random.Random(seed)
    blocks, events = ReplicaBlocks(), []
    ids, n = prompt.ids, int(len(prompt.keys(size)) * fraction)
    if n:
        events.append(BlockStored(tuple(rng.randbytes(32) for _ in range(n)), None,
                                  tuple(ids[:n * size]), size, medium="GPU"))
    held, k = n, 16
    while held < INDEX_BLOCKS:  # other prompts' chains, of tokens no prompt here has
        base = 1_000_000 + held * size
        events.append(BlockStored(tuple(rng.randbytes(32) for _ in range(k)), None,
                                  tuple(range(base, base + k * size)), size, medium="GPU"))
        held += k
    blocks.apply(EventBatch(0.0, tuple(events)))
    blocks.connected = True
    return blocks


def bench_requests(tok: ModelTokenizer, tokens: int, rounds: int, scale: float
                   ) -> dict[str, Any]:
    text = chat_text(tok, tokens, seed=tokens)
    messages = [{"role": "user", "content": text}]
    ids = tok.encode(text, add_special_tokens=False)
    n = max(3, int(200_000 * scale / tokens))
    prompt = PromptKeys(ids)
    prompt.keys(16)
    typical = ([index_holding(prompt, 1.0, 1), index_holding(prompt, 0.5, 2)]
               + [index_holding(prompt, 0.0, 3 + i) for i in range(REPLICAS - 2)])
    worst = [index_holding(prompt, 1.0, 20 + i) for i in range(REPLICAS)]  # all hold all
    now = time.monotonic()
    assert typical[0].matched(prompt, now) == len(prompt.keys(16))
    miss = typical[-1]
    slack = tok.special_token_slack(False)
    return {
        "prompt_tokens": len(ids), "prompt_bytes": len(text.encode()),
        "blocks_16": len(prompt.keys(16)),
        "render_chat_us": per_call_us(lambda: tok.render_chat(messages), n, rounds),
        "bound_us": per_call_us(lambda: len(text.encode("utf-8")) + slack, n, rounds),
        "encode_us": per_call_us(lambda: tok.encode(text, add_special_tokens=False), n, rounds),
        # the same ids without offsets (what count_text uses): a cheaper path for token_ids
        "encode_fast_us": per_call_us(
            lambda: tok._encode_many([text], add_special_tokens=False)[0].ids, n, rounds),
        "keys16_us": per_call_us(lambda: PromptKeys(ids).keys(16), n, rounds),
        "keys32_us": per_call_us(lambda: PromptKeys(ids).keys(32), n, rounds),
        "matched8_us": per_call_us(lambda: [r.matched(prompt, now) for r in typical], n, rounds),
        "matched8_worst_us": per_call_us(lambda: [r.matched(prompt, now) for r in worst], n,
                                         rounds),
        "note_sent_us": per_call_us(lambda: miss.note_sent(prompt, 0, now), n, rounds),
    }


def request_totals(r: dict[str, Any]) -> dict[str, Any]:
    new = sum(r[k]["median"] for k in ("encode_us", "keys16_us", "matched8_us", "note_sent_us"))
    added = new - r["bound_us"]["median"]
    return {"added_us": added, **{f"share_of_{k}": added / v for k, v in REQUEST_CPU_US.items()}}


# --- the run ---------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               "?") if Path("/proc/cpuinfo").exists() else "?"
    return {"nproc": os.cpu_count(), "cpu": cpu, "uptime": load,
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}


def table(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"machine: nproc {m['nproc']}, {m['cpu']}, Python {m['python']}",
             f"uptime before: {m['uptime']}", f"uptime after:  {res['uptime_after']}",
             f"figures: median (min-max) over {res['rounds']} rounds", "",
             "| per event (subscriber) | µs per event | µs per batch | events per core-second |",
             "|---|---:|---:|---:|"]
    for ev in res["events"]:
        bs = ev["block_size"]
        lines += [
            f"| decode, {bs}-token blocks | {fmt(ev['decode_us_per_event'])} | | |",
            f"| apply, {bs}-token blocks | {fmt(ev['apply_us_per_event'])} | | |",
            f"| decode + apply, {bs}-token blocks | {fmt(ev['decode_apply_us_per_event'])} | "
            f"{fmt(ev['decode_apply_us_per_batch'])} | "
            f"{fmt(ev['decode_apply_events_per_core_s'], 0)} |"]
    for z in res["zmq"]:
        lines.append(f"| ZMQ PUB -> EventSubscriber, {z['block_size']}-token blocks | "
                     f"{fmt(z['cpu_us_per_event'])} | | {fmt(z['events_per_core_s'], 0)} |")
    ev0 = res["events"][0]
    lines += ["", f"(a batch: {ev0['events'] / ev0['batches']:.1f} events, "
              f"{ev0['stored_blocks'] / ev0['stored_events']:.1f} blocks a BlockStored, "
              f"{ev0['removed_blocks'] / max(1, ev0['removed_events']):.1f} hashes a "
              f"BlockRemoved, {ev0['payload_bytes_per_batch']:,.0f} bytes; the index at "
              f"{ev0['index_blocks']:,} blocks)", "",
              "| per request, µs | " + " | ".join(f"{r['prompt_tokens']:,} tokens "
                                                   f"({r['prompt_bytes'] / 1024:.1f} KiB)"
                                                   for r in res["requests"]) + " |",
              "|---|" + "---:|" * len(res["requests"])]
    rows = [("render the chat template (before and now)", "render_chat_us"),
            ("one-token-per-byte bound (before)", "bound_us"),
            ("tokenize: ModelTokenizer.encode (now)", "encode_us"),
            ("tokenize: encode_batch_fast, no offsets (not used)", "encode_fast_us"),
            ("PromptKeys.keys(16)", "keys16_us"), ("PromptKeys.keys(32)", "keys32_us"),
            ("matched, 8 replicas (1 full, 1 half, 6 misses)", "matched8_us"),
            ("matched, 8 replicas all holding it (worst)", "matched8_worst_us"),
            ("note_sent (no block held yet)", "note_sent_us")]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(r[key]) for r in res["requests"]) + " |")
    lines.append("| **added per request** (encode + keys(16) + matched + note_sent - bound) | "
                 + " | ".join(f"**{t['added_us']:,.1f}**" for t in res["request_totals"]) + " |")
    for k in REQUEST_CPU_US:
        lines.append(f"| added / {REQUEST_CPU_US[k]:.0f} µs per request ({k}) | "
                     + " | ".join(f"{t['share_of_' + k]:.2f}" for t in res["request_totals"])
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global INDEX_BLOCKS
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_events_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--batches", type=int, default=20_000,
                        help="event batches timed per round (default 20,000)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="request iterations, as a share of the default (default 1)")
    parser.add_argument("--index-blocks", type=int, default=INDEX_BLOCKS,
                        help="blocks each replica's index holds (default 60,000)")
    parser.add_argument("--out", default="kv-events-cost.json", help="JSON results file")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batches < 10 or args.scale <= 0:
        parser.error("--rounds >= 1, --batches >= 10, --scale > 0")
    INDEX_BLOCKS = args.index_blocks
    cores = None
    if len(os.sched_getaffinity(0)) >= 2:
        a, b = sorted(os.sched_getaffinity(0))[:2]
        cores = (a, b)
        os.sched_setaffinity(0, {a})
    res: dict[str, Any] = {"machine": machine(), "rounds": args.rounds}
    res["events"] = [bench_events(bs, args.batches, args.rounds) for bs in (16, 32)]
    res["zmq"] = [bench_zmq(bs, args.batches, args.rounds, cores) for bs in (16, 32)]
    tok = ModelTokenizer.from_dir(builtin_model_dir())
    res["requests"] = [bench_requests(tok, t, args.rounds, args.scale) for t in PROMPT_TOKENS]
    res["request_totals"] = [request_totals(r) for r in res["requests"]]
    res["uptime_after"] = subprocess.run(["uptime"], capture_output=True,
                                         text=True).stdout.strip()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
