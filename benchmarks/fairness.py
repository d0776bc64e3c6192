"""Fair sharing under overload: a light API key's TTFT beside a flooding one, FIFO vs fair.

    python -m benchmarks.fairness [--seconds S] [--light-rate R] [--flood-factor F]
                                     [--out FILE.json]

Two simulated vLLM replicas (paced: 50 ms to the first token, 10 ms per token, 32 tokens a
request) behind two gateways that differ only in ``backpressure.queueing`` (fifo, fair);
each replica takes 4 requests at a time (``max_in_flight_per_replica``), so the fleet serves
about 21 requests/s and the rest wait in the gateway's queue. Two API keys, equal weights:
``light`` sends R streamed requests/s, ``flood`` F times as many (open loop, Poisson,
seeded). Reported: the light key's TTFT p50/p99 alone (unloaded), then with the flood
through the FIFO gateway and through the fair one, one after the other on the same replicas;
and what the flood got (served, refused with 429).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from gateway.access.secret import hash_secret
from gateway.bench.loadgen import Request, Target, open_loop, poisson_arrivals
from benchmarks.harness import HOST, MODEL, free_port, start, stop, wait_ready
from gateway.bench.report import distribution_ms

SECRETS = {"light": "sk-gw-bench-light-0123456789", "flood": "sk-gw-bench-flood-0123456789"}
SIM = ["--profile", "paced", "--ttft-ms", "50", "--itl-ms", "10"]
OUTPUT_TOKENS = 32
SLOTS_PER_REPLICA = 4


@contextlib.contextmanager
def fleet() -> Iterator[dict[str, str]]:
    """Two replicas and one gateway per queueing discipline; yields {discipline: URL}."""
    tmp = Path(tempfile.mkdtemp(prefix="gw-fairness-"))
    procs = []
    try:
        urls = []
        for i in range(2):
            port = free_port()
            proc = start(["sim", "--dialect", "vllm", *SIM, "--port", str(port), "--model",
                          MODEL, "--max-model-len", "4096"], None, tmp / f"replica-{i}.log")
            procs.append(proc)
            wait_ready(f"http://{HOST}:{port}/health", proc)
            urls.append(f"http://{HOST}:{port}")
        gateways = {}
        for queueing in ("fifo", "fair"):
            config = {"models": [{"name": MODEL, "replicas": [
                          {"url": u, "engine": "vllm"} for u in urls]}],
                      "auth": {"keys": [{"name": n, "sha256": hash_secret(s)}
                                        for n, s in SECRETS.items()]},
                      "backpressure": {"max_in_flight_per_replica": SLOTS_PER_REPLICA,
                                       "queue_timeout": 30, "queueing": queueing}}
            path = tmp / f"{queueing}.yaml"
            path.write_text(json.dumps(config))
            port = free_port()
            proc = start(["serve", "--config", str(path), "--port", str(port), "--log-level",
                          "warning"], None, tmp / f"gateway-{queueing}.log")
            procs.append(proc)
            wait_ready(f"http://{HOST}:{port}/ready", proc)
            gateways[queueing] = f"http://{HOST}:{port}"
        yield gateways
    finally:
        for proc in reversed(procs):
            stop(proc)


def target(url: str, key: str) -> Target:
    return Target(url, model=MODEL, stream=True,
                  headers={"Authorization": f"Bearer {SECRETS[key]}"})


async def phase(url: str, seconds: float, light_rate: float, flood_rate: float | None,
                seed: int) -> dict[str, Any]:
    request = [Request(prompt="Tell me about fair queueing.", max_tokens=OUTPUT_TOKENS)]
    n_light = int(light_rate * seconds)
    runs = [open_loop(target(url, "light"), request,
                      poisson_arrivals(light_rate, n_light, seed), timeout=60)]
    if flood_rate:
        n_flood = int(flood_rate * seconds)
        runs.append(open_loop(target(url, "flood"), request,
                              poisson_arrivals(flood_rate, n_flood, seed + 1), timeout=60))
    results = await asyncio.gather(*runs)
    out: dict[str, Any] = {}
    for name, run in zip(("light", "flood"), results):
        ok = [r for r in run.records if r.ok]
        errors: dict[str, int] = {}
        for r in run.records:
            if not r.ok:
                kind = f"{r.error} {r.status}" if r.status else str(r.error)
                errors[kind] = errors.get(kind, 0) + 1
        out[name] = {"sent": len(run.records), "ok": len(ok), "errors": errors,
                     "ttft_ms": distribution_ms(r.ttft for r in ok if r.ttft is not None)}
    return out


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    flood_rate = args.light_rate * args.flood_factor
    with fleet() as gateways:
        results: dict[str, Any] = {}
        results["unloaded"] = await phase(gateways["fair"], args.seconds, args.light_rate,
                                          None, args.seed)
        for queueing in ("fifo", "fair"):
            print(f"  {queueing}: light {args.light_rate:g}/s + flood {flood_rate:g}/s",
                  file=sys.stderr, flush=True)
            results[queueing] = await phase(gateways[queueing], args.seconds,
                                            args.light_rate, flood_rate, args.seed)
            await asyncio.sleep(2)  # the queue drains before the next phase
    return results


def table(results: dict[str, Any]) -> str:
    rows = ["| light key's TTFT | p50 ms | p99 ms | light served / sent | flood served / sent "
            "(refused) |", "|---|---:|---:|---:|---:|"]
    labels = {"unloaded": "alone (unloaded)", "fifo": "with the flood, FIFO queue",
              "fair": "with the flood, fair queueing"}
    for key, label in labels.items():
        r = results[key]
        light, flood = r["light"], r.get("flood")
        flood_cell = (f"{flood['ok']} / {flood['sent']} ({sum(flood['errors'].values())})"
                      if flood else "")
        rows.append(f"| {label} | {light['ttft_ms']['p50']:,.0f} | {light['ttft_ms']['p99']:,.0f}"
                    f" | {light['ok']} / {light['sent']} | {flood_cell} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fairness",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase (default 20)")
    parser.add_argument("--light-rate", type=float, default=3.0,
                        help="light key's streamed requests/s (default 3: with the flood, "
                             "1.5 times what the fleet serves)")
    parser.add_argument("--flood-factor", type=float, default=10.0,
                        help="the flood's rate as a multiple of the light key's (default 10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="fairness.json", help="JSON results file")
    args = parser.parse_args(argv)
    if not (0 < args.seconds <= 120 and 0 < args.light_rate <= 50
            and 1 <= args.flood_factor <= 100):
        parser.error("out of bounds: --seconds (0, 120], --light-rate (0, 50], "
                     "--flood-factor [1, 100]")
    started = time.time()
    results = asyncio.run(run_all(args))
    report = {"command": " ".join(["python -m benchmarks.fairness",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "setup": {"replicas": 2, "sim": " ".join(SIM), "output_tokens": OUTPUT_TOKENS,
                        "slots_per_replica": SLOTS_PER_REPLICA, **vars(args)},
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
