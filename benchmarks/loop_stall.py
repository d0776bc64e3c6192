"""What work on the gateway's event loop does to the streams in flight: the gaps between
stream events, undisturbed, while /metrics is scraped, and while a client sends long
prompts, side by side.

    python -m benchmarks.loop_stall [--replicas N] [--rounds N] [--streams C]
                                    [--baseline CHECKOUT] [--out FILE.json]

N simulated vLLM replicas (paced: a token every 10 ms) behind a gateway that has the model's
tokenizer (and, with ``--baseline``, another checkout's gateway with the same config,
measured in turn). First every replica serves each route and API once in a while, so
/metrics holds the series a fleet that has served for a while holds (each replica x route x
API has its histograms). Then, per round and gateway: C concurrent streams of 200 tokens,
three times: alone; with a scraper asking for /metrics every 0.2 s; with a client sending a
completion whose prompt is 1 MB (counted, then refused: past the 4,096-token window) every
0.2 s. Reported per gateway: the size of /metrics, how long a scrape and a refusal took to
answer, and the gaps between consecutive events the clients saw (p50, p99, max) in each
case. Work done on the event loop stops every stream while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import yaml

from benchmarks.harness import HOST, MODEL, ROOT, free_port, start, stop, wait_ready
from gateway.bench.report import percentile
from gateway.sim.model_dir import write_model_dir

ITL_MS = 10
TOKENS = 200
WINDOW = 4096
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * (1_000_000 // 44)  # ~1 MB
ROUTES = [("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
          ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
          ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}]}),
          ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
          ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})]
CASES = ("alone", "scrapes", "long_prompts")


@contextlib.contextmanager
def fleet(replicas: int, checkouts: dict[str, Path], tmp: Path
          ) -> Iterator[dict[str, str]]:
    """The replicas and one gateway per checkout; yields {name: gateway URL}."""
    procs = []
    try:
        urls = []
        for i in range(replicas):
            for attempt in (1, 2):  # a free port can be taken before the replica binds it
                port = free_port()
                proc = start(["sim", "--dialect", "vllm", "--profile", "paced", "--ttft-ms",
                              "5", "--itl-ms", str(ITL_MS), "--port", str(port), "--model",
                              MODEL, "--max-model-len", str(WINDOW)], None, tmp / f"sim{i}.log")
                procs.append(proc)
                try:
                    wait_ready(f"http://{HOST}:{port}/health", proc)
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
            urls.append(f"http://{HOST}:{port}")
        tokenizer = write_model_dir(tmp / "model", vocab_size=8192)
        config = {"models": [{"name": MODEL, "tokenizer": str(tokenizer), "replicas": [
            {"url": u, "engine": "vllm", "name": f"gpu{i}"} for i, u in enumerate(urls)]}],
            "balancer": "round_robin"}
        (tmp / "gateway.yaml").write_text(yaml.safe_dump(config))
        gateways = {}
        for name, checkout in checkouts.items():
            port = free_port()
            proc = start(["serve", "--config", str(tmp / "gateway.yaml"), "--port", str(port),
                          "--log-level", "warning"], None, tmp / f"gateway-{name}.log", checkout)
            procs.append(proc)
            gateways[name] = f"http://{HOST}:{port}"
            wait_ready(gateways[name] + "/ready", proc)
        yield gateways
    finally:
        for proc in procs:
            stop(proc)


async def warm(client: httpx.AsyncClient, gateway: str, replicas: int) -> None:
    """Each route on every replica (round robin), so /metrics has every series."""
    for _ in range(replicas):
        await asyncio.gather(*(client.post(gateway + path, json=body) for path, body in ROUTES))


async def stream_gaps(client: httpx.AsyncClient, gateway: str) -> list[float]:
    """Seconds between consecutive events of one stream of TOKENS tokens."""
    gaps: list[float] = []
    body = {"model": MODEL, "prompt": "hi", "max_tokens": TOKENS, "stream": True}
    async with client.stream("POST", gateway + "/v1/completions", json=body) as response:
        last = None
        async for line in response.aiter_lines():
            if not line:  # the blank line that ends each event
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps[1:]  # from the second token on (the first waits for TTFT)


def scrape(client: httpx.AsyncClient, gateway: str) -> Any:
    return client.get(gateway + "/metrics")


def long_prompt(client: httpx.AsyncClient, gateway: str) -> Any:
    return client.post(gateway + "/v1/completions",
                       json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 16})


DISTURBANCES: dict[str, Callable[[httpx.AsyncClient, str], Any]] = {
    "scrapes": scrape, "long_prompts": long_prompt}


async def disturb(client: httpx.AsyncClient, gateway: str, case: str, stop_at: asyncio.Event,
                  took: list[float], sizes: list[int]) -> None:
    """The case's request every 0.2 s until the streams end."""
    while not stop_at.is_set():
        t = time.perf_counter()
        response = await DISTURBANCES[case](client, gateway)
        took.append(time.perf_counter() - t)
        sizes.append(len(response.content))
        await asyncio.sleep(0.2)


async def one_round(gateway: str, streams: int, case: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        took: list[float] = []
        sizes: list[int] = []
        done = asyncio.Event()
        task = (asyncio.create_task(disturb(client, gateway, case, done, took, sizes))
                if case in DISTURBANCES else None)
        results = await asyncio.gather(*(stream_gaps(client, gateway) for _ in range(streams)))
        done.set()
        if task is not None:
            await task
    return {"gaps": [g for r in results for g in r], "took_s": took, "bytes": sizes}


async def measure(gateways: dict[str, str], replicas: int, rounds: int,
                  streams: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        for url in gateways.values():
            await warm(client, url, replicas)
    out: dict[str, Any] = {name: {case: [] for case in CASES} for name in gateways}
    order = list(gateways)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            for case in (CASES if r % 2 == 0 else CASES[::-1]):
                out[name][case].append(await one_round(gateways[name], streams, case))
    summary: dict[str, Any] = {}
    for name, runs in out.items():
        row: dict[str, Any] = {}
        for case, segments in runs.items():
            gaps = sorted(g * 1000 for s in segments for g in s["gaps"])
            took = [t * 1000 for s in segments for t in s["took_s"]]
            row[case] = {"events": len(gaps), "p50_ms": percentile(gaps, 50),
                         "p99_ms": percentile(gaps, 99), "max_ms": gaps[-1],
                         "per_round_max_ms": [max(s["gaps"]) * 1000 for s in segments],
                         "requests": len(took),
                         "answered_ms_median": statistics.median(took) if took else None,
                         "answer_bytes": max((b for s in segments for b in s["bytes"]),
                                             default=None)}
        summary[name] = row
    return summary


def table(res: dict[str, Any]) -> str:
    rows = ["| gateway | case | gaps p50 / p99 / max | largest gap per round | its request "
            "answered in (median) |", "|---|---|---|---|---|"]
    for name, row in res.items():
        for case in CASES:
            c = row[case]
            answered = ("" if c["answered_ms_median"] is None else
                        f"{c['answered_ms_median']:.1f} ms ({c['answer_bytes']:,} bytes)")
            rows.append(f"| {name} | {case} | {c['p50_ms']:.1f} / {c['p99_ms']:.1f} / "
                        f"{c['max_ms']:.1f} ms | "
                        f"{', '.join(f'{x:.0f}' for x in c['per_round_max_ms'])} ms | {answered} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loop_stall",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--baseline", type=Path, help="another checkout's gateway, beside this")
    parser.add_argument("--out", default="loop_stall.json")
    args = parser.parse_args(argv)
    if not (1 <= args.replicas <= 32 and 1 <= args.rounds <= 20 and 1 <= args.streams <= 128):
        parser.error("--replicas 1-32, --rounds 1-20, --streams 1-128")
    checkouts = {"this": ROOT}
    if args.baseline is not None:
        if not (args.baseline / "gateway").is_dir():
            parser.error(f"--baseline {args.baseline}: no gateway package there")
        checkouts["baseline"] = args.baseline.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="gw-loop-stall-"))
    with fleet(args.replicas, checkouts, tmp) as gateways:
        res = asyncio.run(measure(gateways, args.replicas, args.rounds, args.streams))
    res["load_average"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(table({k: v for k, v in res.items() if k != "load_average"}))
    print(f"load average {' '.join(f'{x:.2f}' for x in res['load_average'])}; "
          f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
