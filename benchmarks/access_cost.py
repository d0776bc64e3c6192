"""What API keys and their limits cost the request path, side by side in one run.

    python -m benchmarks.access_cost [--duration S] [--rounds N] [--out FILE.json]

One simulated vLLM replica (``--profile instant``) on core 1 and, on core 0, four gateways
in front of it, identical but for ``auth``: off; keys without limits; keys with limits in
this process; keys with limits in Redis (127.0.0.1:6379, a private key prefix, deleted
afterwards). A closed loop of 32 users sends non-streaming completions (max_tokens 16) to
each in turn (A B C D D C B A per round, so drift cancels out); reported: requests/s and the
gateway's CPU time per request, and each one's ratio to "off".

Then, inside this process, the admission itself: N sequential acquire + release of one key
with the Redis script (one round trip) and with the in-process buckets, p50/p99 in µs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from gateway.access.keys import ApiKey
from gateway.access.limits import LocalLimiter
from gateway.access.redis_limits import RedisLimiter
from gateway.access.secret import hash_secret
from gateway.bench.loadgen import Request, Target, closed_loop
from benchmarks.harness import (GATEWAY_CORE, HOST, MODEL, REPLICA_CORE, cpu_seconds, free_port,
                                pin_client, start, stop, wait_ready)
from gateway.config import KeyLimits
from gateway.shared.redis_keys import SharedKeys
from gateway.shared.sync import connect

REDIS = "redis://127.0.0.1:6379/0"
SECRET = "sk-gw-bench-0123456789abcdef"
HIGH = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12,
        "concurrent_requests": 100000}  # never reached: the cost of checking, not refusing
VARIANTS = {
    "off": None,
    "keys": {"keys": [{"name": "bench", "sha256": hash_secret(SECRET)}]},
    "limits (in process)": {"keys": [{"name": "bench", "sha256": hash_secret(SECRET),
                                      "limits": HIGH}]},
    "limits (Redis)": {"keys": [{"name": "bench", "sha256": hash_secret(SECRET),
                                 "limits": HIGH}]},
}


@contextlib.contextmanager
def fleet(prefix: str) -> Iterator[tuple[dict[str, int], dict[str, int]]]:
    tmp = Path(tempfile.mkdtemp(prefix="gw-access-"))
    rport = free_port()
    procs = []
    try:
        replica = start(["sim", "--dialect", "vllm", "--profile", "instant", "--port",
                         str(rport), "--model", MODEL, "--max-model-len", "4096"],
                        REPLICA_CORE, tmp / "replica.log")
        procs.append(replica)
        wait_ready(f"http://{HOST}:{rport}/health", replica)
        ports, pids = {}, {}
        for name, auth in VARIANTS.items():
            config: dict[str, Any] = {"models": [{"name": MODEL, "replicas": [
                {"url": f"http://{HOST}:{rport}", "engine": "vllm"}]}], "auth": auth}
            if name == "limits (Redis)":
                config.update(redis_url=REDIS, redis_key_prefix=prefix)
            path = tmp / f"{len(ports)}.yaml"
            path.write_text(json.dumps(config))
            port = free_port()
            proc = start(["serve", "--config", str(path), "--port", str(port),
                          "--log-level", "warning"], GATEWAY_CORE, tmp / f"{len(ports)}.log")
            procs.append(proc)
            wait_ready(f"http://{HOST}:{port}/ready", proc)
            ports[name], pids[name] = port, proc.pid
        yield ports, pids
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} died during the run; see {tmp}")
    finally:
        for proc in reversed(procs):
            stop(proc)


async def segment(port: int, pid: int, seconds: float) -> tuple[float, float]:
    """(requests/s, gateway CPU µs per request) of one closed-loop segment."""
    target = Target(f"http://{HOST}:{port}", model=MODEL,
                    headers={"Authorization": f"Bearer {SECRET}"})
    requests = [Request(prompt="Say something about the weather in a few words.",
                        max_tokens=16)]
    cpu = cpu_seconds(pid)
    began = time.perf_counter()
    run = await closed_loop(target, requests, users=32, duration=seconds, timeout=30)
    wall = time.perf_counter() - began
    cpu = cpu_seconds(pid) - cpu
    ok = sum(r.ok for r in run.records)
    failed = len(run.records) - ok
    if failed:
        raise RuntimeError(f"{failed} requests failed on :{port}")
    return ok / wall, cpu / ok * 1e6


async def admission_cost(n: int, prefix: str) -> dict[str, dict[str, float]]:
    key = ApiKey("bench", hash_secret(SECRET), None, 1.0, KeyLimits(**HIGH))
    redis = connect(REDIS, 0.5)
    out = {}
    try:
        limiters = {"Redis": RedisLimiter(redis, SharedKeys(prefix), 60.0, 120.0, "bench"),
                    "in process": LocalLimiter(60.0)}
        for name, limiter in limiters.items():
            times = []
            for _ in range(n):
                began = time.perf_counter()
                outcome = await limiter.acquire(key, 500)
                times.append(time.perf_counter() - began)
                assert not outcome.why, outcome
                limiter.release(key, outcome.lease, 400)
                if isinstance(limiter, RedisLimiter):
                    await asyncio.sleep(0)  # let the settle go out, as between requests
            if isinstance(limiter, RedisLimiter):
                await limiter.close()
            times.sort()
            out[name] = {"p50_us": round(times[n // 2] * 1e6, 1),
                         "p99_us": round(times[int(n * 0.99)] * 1e6, 1)}
    finally:
        await redis.aclose()
    return out


async def main_async(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    results: dict[str, Any] = {"segments": {name: [] for name in VARIANTS}}
    with fleet(prefix) as (ports, pids):
        names = list(VARIANTS)
        for name in names:  # warm-up
            await segment(ports[name], pids[name], 0.5)
        for _ in range(args.rounds):
            for name in names + names[::-1]:
                rps, cpu = await segment(ports[name], pids[name], args.duration)
                results["segments"][name].append({"rps": round(rps, 1),
                                                  "cpu_us_per_request": round(cpu, 1)})
    base_rps = statistics.median(s["rps"] for s in results["segments"]["off"])
    base_cpu = statistics.median(s["cpu_us_per_request"] for s in results["segments"]["off"])
    summary = {}
    for name, segs in results["segments"].items():
        rps = [s["rps"] for s in segs]
        cpu = [s["cpu_us_per_request"] for s in segs]
        summary[name] = {"rps_median": statistics.median(rps), "rps_min": min(rps),
                         "rps_max": max(rps), "cpu_us_median": statistics.median(cpu),
                         "rps_ratio": round(statistics.median(rps) / base_rps, 3),
                         "cpu_ratio": round(statistics.median(cpu) / base_cpu, 3)}
    results["summary"] = summary
    results["admission"] = await admission_cost(args.admissions, prefix)
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| auth | requests/s (median, min-max) | vs off | gateway CPU µs/request | vs off |",
             "|---|---|---|---|---|"]
    for name, s in results["summary"].items():
        lines.append(f"| {name} | {s['rps_median']:.0f} ({s['rps_min']:.0f}-{s['rps_max']:.0f})"
                     f" | {s['rps_ratio']:.3f} | {s['cpu_us_median']:.0f} | {s['cpu_ratio']:.3f} |")
    lines += ["", "| admission (acquire, one key) | p50 µs | p99 µs |", "|---|---|---|"]
    for name, s in results["admission"].items():
        lines.append(f"| {name} | {s['p50_us']} | {s['p99_us']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per segment")
    parser.add_argument("--rounds", type=int, default=2, help="A B C D D C B A rounds")
    parser.add_argument("--admissions", type=int, default=2000,
                        help="sequential admissions timed per limiter")
    parser.add_argument("--out", default="access-cost.json", help="JSON results file")
    args = parser.parse_args(argv)
    pin_client()
    prefix = f"llm-gateway-bench:{uuid.uuid4().hex[:8]}:"
    try:
        results = asyncio.run(main_async(args, prefix))
    finally:
        import redis
        client = redis.Redis.from_url(REDIS)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
