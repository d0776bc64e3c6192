"""Measure the simulator (not a test; loopback only, bounded in time).

    python tests/sim/measure_sim.py instant   # sim pinned to core 0, this load generator to core 1
    python tests/sim/measure_sim.py a100      # closed loop at 10/50/100 users, --speed 4

``instant``: streamed tokens/s (64 concurrent streams of 256 tokens) and non-streaming
requests/s (64 concurrent, 16 tokens), in wall time on one core.
``a100``: output tokens/s from the replica's own counters over simulated time, and client-side
TTFT p50 (wall x speed), prompt ~512 tokens, output 256, beside the published figures.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.support import free_port, wait_ready  # noqa: E402


def start(args: list[str], core: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "sim", "--port", str(port), *args]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/health", 30, proc)
    return proc, base


async def stream_load(base: str, body: dict, concurrency: int, seconds: float,
                      ramp: float = 0.0) -> tuple[int, int, list[float]]:
    """Closed loop of streaming requests, users starting evenly over ``ramp`` seconds (so they
    do not stay in lock-step); returns (requests, token events, TTFTs in wall seconds)."""
    deadline = time.monotonic() + seconds
    done, events, ttfts = 0, 0, []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def user(u: int) -> None:
            nonlocal done, events
            await asyncio.sleep(ramp * u / concurrency)
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                first = True
                async with session.post(f"{base}/v1/completions", json=body(u) if callable(body) else body) as r:
                    async for chunk in r.content.iter_any():
                        if first:
                            ttfts.append(time.monotonic() - t0)
                            first = False
                        events += chunk.count(b'"text":')
                done += 1
        await asyncio.gather(*(user(u) for u in range(concurrency)))
    return done, events, ttfts


async def request_load(base: str, body: dict, concurrency: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def user() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                async with session.post(f"{base}/v1/completions", json=body) as r:
                    await r.read()
                done += 1
        await asyncio.gather(*(user() for _ in range(concurrency)))
    return done


def measure_instant() -> None:
    os.sched_setaffinity(0, {1})
    proc, base = start(["--dialect", "vllm", "--profile", "instant", "--model", "m", "--max-model-len", "4096"], 0)
    try:
        seconds = 6.0
        body = {"prompt": "Hello world", "max_tokens": 256, "stream": True}
        asyncio.run(stream_load(base, body, 64, 1.0))  # warm up
        reqs, events, _ = asyncio.run(stream_load(base, body, 64, seconds))
        print(f"instant, streaming: 64 streams x 256 tokens: {events / seconds:,.0f} tokens/s, "
              f"{reqs / seconds:,.0f} streams/s")
        n = asyncio.run(request_load(base, {"prompt": "Hello world", "max_tokens": 16}, 64, seconds))
        print(f"instant, non-streaming: 64 concurrent, 16 tokens: {n / seconds:,.0f} requests/s")
    finally:
        proc.terminate()
        proc.wait()


def measure_a100(speed: float = 4.0, seconds: float = 16.0) -> None:
    proc, base = start(["--dialect", "vllm", "--profile", "llama3-8b-a100", "--model", "m",
                        "--max-model-len", "8192", "--speed", str(speed)], None)
    try:
        filler = "the quick brown fox jumps over the lazy dog " * 60
        ids = httpx.post(f"{base}/tokenize", json={"prompt": filler}).json()["tokens"]

        def body(u: int) -> dict:  # ~512 distinct prompt tokens per user
            return {"prompt": [1000 + u] + ids[: 511], "max_tokens": 256, "stream": True}

        print(f"llama3-8b-a100 (vLLM dialect), prompt 512, output 256, closed loop, --speed {speed}")
        print(f"{'users':>6} {'output tok/s':>13} {'TTFT p50 ms':>12}   published (BentoML 2024, vLLM)")
        published = {10: "", 50: "", 100: "~2,300-2,500 tok/s; fastest engine ~4,000"}
        async def window(users: int) -> tuple[dict, dict, list[float]]:
            async def sample(at: float) -> dict:
                await asyncio.sleep(at)
                return await asyncio.to_thread(lambda: httpx.get(f"{base}/sim/state").json())
            load = asyncio.ensure_future(stream_load(base, body, users, seconds, ramp=2.0))
            s0, s1 = await asyncio.gather(sample(4.0), sample(seconds - 1.0))  # steady state only
            _, _, ttfts = await load
            return s0, s1, ttfts[len(ttfts) // 3:]

        for users in (10, 50, 100):
            s0, s1, ttfts = asyncio.run(window(users))
            tput = (s1["generation_tokens_total"] - s0["generation_tokens_total"]) / (s1["sim_time_s"] - s0["sim_time_s"])
            print(f"{users:>6} {tput:>13,.0f} {statistics.median(ttfts) * speed * 1000:>12.1f}   {published[users]}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "instant"
    measure_instant() if which == "instant" else measure_a100()
