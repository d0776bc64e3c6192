"""Several gateway instances sharing load through Redis, measured side by side in one run.

    python -m benchmarks.shared_state --out results/     # about 8 minutes on 2 cores

1. Cost: one gateway without Redis vs one with ``redis_url`` (syncing every 100 ms), in front
   of the same ``instant`` simulated replica, A B B A: non-streaming requests/s at 32 users,
   and streaming TTFT p50/p99 at one user next to the replica direct (the added latency).
2. Balance quality: 4 simulated vLLM replicas on the calibrated ``llama3-8b-a100`` profile,
   least_outstanding_tokens, the suite's seeded open-loop mix (85% short, 15% long prompts,
   ``benchmarks.suite``), through 1 instance, 2 instances blind to each other (no Redis)
   and 2 instances sharing Redis; with 2 instances request i goes to instance i mod 2, as a
   load balancer in front of them would spread it. Figures in simulated time, medians over
   rounds: TTFT p50/p99 and the spread of outstanding tokens across the replicas (max - min,
   sampled every 20 ms while requests arrive), computed from the client's own records (prompt
   until its first token + output still expected), not from any gateway's view.

Writes ``shared_state.json`` and ``shared_state.md`` into --out. Keys go under a fresh prefix
on --redis-url and are deleted at the end; every phase and request is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import redis

from gateway.bench.loadgen import Record, Request, Target, closed_loop, open_loop, poisson_arrivals
from benchmarks.harness import (HOST, cpu_seconds, free_port, machine_info, start, stop, wait_ready)
from gateway.bench.report import distribution_ms, summarize_records
from benchmarks.suite import (MODEL, REPLICAS, heterogeneous_requests, replicas,
                                 simulated, wait_idle)

ROWS = ("1 instance", "2 instances, blind", "2 instances, shared (Redis)")
SAMPLE_EVERY = 0.02  # seconds (wall) between samples of the outstanding-token spread


@dataclass(frozen=True)
class Instance:
    url: str
    pid: int


@contextlib.contextmanager
def gateways(urls: list[str], count: int, tmp: Path, redis_url: str | None = None,
             prefix: str = "", tokenizer: bool = True,
             sync_interval: float = 0.1) -> Iterator[list[Instance]]:
    """``count`` gateway processes with one config (shared state when ``redis_url``)."""
    from gateway.sim.model_dir import builtin_model_dir
    model: dict[str, Any] = {"name": MODEL, "max_model_len": 8192,
                             "replicas": [{"url": u, "engine": "vllm", "name": f"gpu{i}"}
                                          for i, u in enumerate(urls)]}
    if tokenizer:
        model["tokenizer"] = str(builtin_model_dir())
    config = tmp / f"gateway-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(json.dumps({"models": [model], "balancer": "least_outstanding_tokens",
                                  "redis_url": redis_url, "redis_key_prefix": prefix or "x:",
                                  "redis_sync_interval": sync_interval}))
    procs, out = [], []
    try:
        for _ in range(count):
            port = free_port()
            procs.append(start(["serve", "--config", str(config), "--port", str(port),
                                "--log-level", "warning"], None, tmp / f"gateway-{port}.log"))
            out.append(f"http://{HOST}:{port}")
        for url, proc in zip(out, procs):
            wait_ready(url + "/ready", proc)
        yield [Instance(url, proc.pid) for url, proc in zip(out, procs)]
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a gateway died during the run; see {tmp}")
    finally:
        for proc in procs:
            stop(proc)


def scrape(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


# --- 1. cost -----------------------------------------------------------------------------------

async def _rps(url: str, seconds: float) -> float:
    run = await closed_loop(Target(url, model=MODEL), [Request("hi", 16)], users=32,
                            duration=seconds, timeout=30)
    ok = [r for r in run.records if r.ok]
    return len(ok) / run.wall


async def _ttft(url: str, seconds: float) -> list[float]:
    run = await closed_loop(Target(url, stream=True, model=MODEL), [Request("hi", 16)],
                            users=1, duration=seconds, timeout=30)
    return [r.ttft for r in run.records if r.ok and r.ttft is not None]


def cost(seconds: float, tmp: Path, redis_url: str, prefix: str) -> dict[str, Any]:
    port = free_port()
    sim = start(["sim", "--dialect", "vllm", "--port", str(port), "--model", MODEL,
                 "--max-model-len", "8192", "--profile", "instant"], None, tmp / "instant.log")
    direct = f"http://{HOST}:{port}"
    try:
        wait_ready(direct + "/health", sim)
        with gateways([direct], 1, tmp, tokenizer=False) as (plain,), \
                gateways([direct], 1, tmp, redis_url, prefix, tokenizer=False) as (shared,):
            targets = {"direct": direct, "without Redis": plain.url, "with Redis": shared.url}
            rps: dict[str, list[float]] = {k: [] for k in targets}
            ttft: dict[str, list[float]] = {k: [] for k in targets}
            for name in ("direct", "without Redis", "with Redis", "with Redis",
                         "without Redis", "direct"):  # A B C C B A
                url = targets[name]
                rps[name].append(asyncio.run(_rps(url, seconds)))
                ttft[name] += asyncio.run(_ttft(url, seconds))
                print(f"  cost: {name:14s} {rps[name][-1]:8.0f} requests/s", file=sys.stderr,
                      flush=True)
            failures = scrape(shared.url, "llm_gateway_shared_state_sync_failures_total")
    finally:
        stop(sim)
    out = {name: {"requests_per_s": round(statistics.mean(rps[name]), 1),
                  "ttft_ms": distribution_ms(ttft[name])} for name in targets}
    for name in ("without Redis", "with Redis"):
        out[name]["added_ttft_p50_ms"] = round(
            out[name]["ttft_ms"]["p50"] - out["direct"]["ttft_ms"]["p50"], 3)
        out[name]["added_ttft_p99_ms"] = round(
            out[name]["ttft_ms"]["p99"] - out["direct"]["ttft_ms"]["p99"], 3)
    out["redis_vs_plain_requests_per_s"] = round(
        out["with Redis"]["requests_per_s"] / out["without Redis"]["requests_per_s"], 3)
    out["sync_failures"] = failures
    return out


# --- 2. balance quality ------------------------------------------------------------------------

def outstanding_spread(records: Sequence[tuple[Record, Request]], start: float,
                       end: float) -> dict[str, float]:
    """Outstanding tokens per replica over time, from the client's records: each request owes
    its prompt until its first token and its expected output minus what has streamed.
    Returns the spread (max - min over replicas) sampled every SAMPLE_EVERY s in [start, end]."""
    deltas: dict[str, list[tuple[float, int]]] = {}
    for record, request in records:
        if record.replica is None or not record.ok:
            continue
        events = deltas.setdefault(record.replica, [])
        prompt = record.prompt_tokens or len(request.prompt.split())
        owed = request.max_tokens
        events.append((record.sent, prompt + owed))
        if record.first_token is not None:
            events.append((record.first_token, -prompt))
        for at, tokens in record.chunks:
            done = min(tokens, owed)
            owed -= done
            events.append((at, -done))
        if record.first_token is None:
            events.append((record.end, -prompt))
        events.append((record.end, -owed))
    timelines = {}
    for replica, events in deltas.items():
        events.sort()
        times = [t for t, _ in events]
        totals, running = [], 0
        for _, delta in events:
            running += delta
            totals.append(running)
        timelines[replica] = (times, totals)
    spreads, levels = [], []
    t = start
    while t <= end:
        values = []
        for times, totals in timelines.values():
            i = bisect.bisect_right(times, t)
            values.append(totals[i - 1] if i else 0)
        values += [0] * (REPLICAS - len(values))
        spreads.append(max(values) - min(values))
        levels.append(statistics.mean(values))
        t += SAMPLE_EVERY
    spreads.sort()
    # Relative to the mean load: a run whose replicas fell behind (CPU noise) owes more
    # everywhere, and its absolute spread grows with it.
    return {"mean": round(statistics.mean(spreads), 1),
            "p95": float(spreads[int(0.95 * (len(spreads) - 1))]),
            "mean_per_replica": round(statistics.mean(levels), 1),
            "relative": round(statistics.mean(spreads) / max(statistics.mean(levels), 1), 3)}


async def drive(urls: list[str], requests: list[Request],
                arrivals: list[float]) -> tuple[list[tuple[Record, Request]], float, float]:
    """Request i through instance i mod len(urls), all on one clock."""
    n = len(urls)
    subsets = [requests[k::n] for k in range(n)]
    runs = await asyncio.gather(*(
        open_loop(Target(url, stream=True, model=MODEL), subsets[k], arrivals[k::n],
                  timeout=120) for k, url in enumerate(urls)))
    pairs = [(record, subsets[k][record.index]) for k, run in enumerate(runs)
             for record in run.records]
    started = min(run.started for run in runs)
    return pairs, started, max(r.end for r, _ in pairs)


def balance(speed: float, rate: float, n: int, rounds: int, seed: int, tmp: Path,
            redis_url: str, prefix: str, sync_interval: float) -> dict[str, Any]:
    requests = heterogeneous_requests(n, seed)
    arrivals = [t / speed for t in poisson_arrivals(rate, n, seed=seed)]
    per_row: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with replicas(REPLICAS, speed, tmp) as urls:
        for r in range(rounds):
            for row in (ROWS if r % 2 == 0 else ROWS[::-1]):
                wait_idle(urls)
                shared = row == ROWS[2]
                with gateways(urls, 1 if row == ROWS[0] else 2, tmp,
                              redis_url if shared else None, prefix,
                              sync_interval=sync_interval) as instances:
                    cpu = sum(cpu_seconds(i.pid) for i in instances)
                    pairs, started, ended = asyncio.run(drive([i.url for i in instances],
                                                              requests, arrivals))
                    cpu = sum(cpu_seconds(i.pid) for i in instances) - cpu
                    leftover = None
                    if shared:  # every instance's published load is back to exactly zero
                        time.sleep(0.5)
                        leftover = sum(int(v.split()[0]) for key in
                                       client.scan_iter(match=f"{prefix}load:*")
                                       for v in client.hvals(key))
                records = [p[0] for p in pairs]
                summary = simulated(summarize_records(records, ended - started), speed)
                steady = (started + 0.1 * arrivals[-1], started + arrivals[-1])
                spread = outstanding_spread(pairs, *steady)
                per_row[row].append({"ttft_ms": summary["ttft_ms"], "errors": summary["errors"],
                                     "spread_tokens": spread, "redis_leftover_tokens": leftover,
                                     "gateway_cpu_ms_per_request": round(1000 * cpu / n, 3)})
                print(f"  balance round {r + 1} {row:28s} TTFT p99 "
                      f"{summary['ttft_ms']['p99']:8.1f} ms (simulated), spread mean "
                      f"{spread['mean']:7.0f} tokens ({spread['relative']:.2f} x mean load), "
                      f"gateway CPU {1000 * cpu / n:.2f} ms/request, errors {summary['errors']}",
                      file=sys.stderr, flush=True)
    client.close()
    out: dict[str, Any] = {}
    for row, runs in per_row.items():
        def median(get: Any) -> float:
            return round(statistics.median(get(x) for x in runs), 1)
        out[row] = {"ttft_p50_ms": median(lambda x: x["ttft_ms"]["p50"]),
                    "ttft_p99_ms": median(lambda x: x["ttft_ms"]["p99"]),
                    "spread_mean_tokens": median(lambda x: x["spread_tokens"]["mean"]),
                    "spread_p95_tokens": median(lambda x: x["spread_tokens"]["p95"]),
                    "mean_outstanding_tokens": median(
                        lambda x: x["spread_tokens"]["mean_per_replica"]),
                    "relative_spread": round(statistics.median(
                        x["spread_tokens"]["relative"] for x in runs), 3),
                    "gateway_cpu_ms_per_request": round(statistics.median(
                        x["gateway_cpu_ms_per_request"] for x in runs), 3),
                    "errors": sum(sum(x["errors"].values()) for x in runs),
                    "rounds": runs}
    return out


# --- report ------------------------------------------------------------------------------------

def markdown(res: dict[str, Any]) -> str:
    c, b = res["cost"], res["balance"]
    lines = ["| target | requests/s (32 users) | stream TTFT p50 / p99 ms (1 user) "
             "| added TTFT p50 / p99 ms |", "|---|---:|---:|---:|"]
    for name in ("direct", "without Redis", "with Redis"):
        t = c[name]["ttft_ms"]
        added = (f"{c[name]['added_ttft_p50_ms']:+.3f} / {c[name]['added_ttft_p99_ms']:+.3f}"
                 if "added_ttft_p50_ms" in c[name] else "")
        lines.append(f"| {name} | {c[name]['requests_per_s']:,.0f} | {t['p50']:.3f} / "
                     f"{t['p99']:.3f} | {added} |")
    lines += ["", f"with Redis / without: {c['redis_vs_plain_requests_per_s']:.3f} x requests/s; "
              f"sync failures {c['sync_failures']:.0f}", "",
              "| gateways | TTFT p50 / p99 ms (simulated) | outstanding-token spread across "
              "replicas, mean / p95 | mean outstanding per replica | spread / mean "
              "| gateway CPU ms per request | errors |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in ROWS:
        x = b[row]
        lines.append(f"| {row} | {x['ttft_p50_ms']:,.0f} / {x['ttft_p99_ms']:,.0f} "
                     f"| {x['spread_mean_tokens']:,.0f} / {x['spread_p95_tokens']:,.0f} "
                     f"| {x['mean_outstanding_tokens']:,.0f} | {x['relative_spread']:.2f} "
                     f"| {x['gateway_cpu_ms_per_request']:.2f} | {x['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shared_state",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--cost-seconds", type=float, default=3.0,
                        help="seconds per cost measurement and target (default 3)")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="simulated clock speed of the balance replicas (default 1)")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="balance arrivals per simulated second (default 40)")
    parser.add_argument("--requests", type=int, default=480,
                        help="balance requests per row and round (default 480)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="balance rounds; figures are medians over rounds (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sync-interval", type=float, default=0.1,
                        help="redis_sync_interval of the sharing instances (default 0.1 s)")
    parser.add_argument("--skip-cost", action="store_true", help="balance quality only")
    args = parser.parse_args(argv)
    if not (0 < args.cost_seconds <= 30 and 0 < args.speed <= 20 and 0 < args.rate <= 200
            and 1 <= args.requests <= 5000 and 1 <= args.rounds <= 6
            and 0.005 <= args.sync_interval <= 1):
        parser.error("out of bounds: --cost-seconds (0, 30], --speed (0, 20], --rate (0, 200], "
                     "--requests [1, 5000], --rounds [1, 6], --sync-interval [0.005, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"llm-gateway-bench:{uuid.uuid4().hex[:8]}:"
    res: dict[str, Any] = {"command": " ".join(["python -m benchmarks.shared_state",
                                                *(argv if argv is not None else sys.argv[1:])]),
                           "machine": machine_info()}
    try:
        with tempfile.TemporaryDirectory(prefix="shared-state-bench-") as tmp:
            if not args.skip_cost:
                res["cost"] = cost(args.cost_seconds, Path(tmp), args.redis_url, prefix)
            res["balance"] = balance(args.speed, args.rate, args.requests, args.rounds,
                                     args.seed, Path(tmp), args.redis_url, prefix,
                                     args.sync_interval)
    finally:
        client = redis.Redis.from_url(args.redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
    (args.out / "shared_state.json").write_text(json.dumps(res, indent=2))
    if "cost" in res:
        text = markdown(res)
        (args.out / "shared_state.md").write_text(f"`{res['command']}`\n\n{text}\n")
        print(text)
    else:
        print(json.dumps({row: {k: v for k, v in x.items() if k != "rounds"}
                          for row, x in res["balance"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
