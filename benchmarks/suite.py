"""The benchmark suite: the gateway's own claims, measured side by side in one run.

    python -m benchmarks.suite --out results/        # about 6 minutes on 2 cores

1. Overhead: direct to an ``instant`` simulated vLLM replica vs through one gateway worker
   (gateway on core 0, replica and load generator on core 1), closed loop at concurrency 1,
   64 and 256, streaming (256 tokens) and not (16 tokens), A B B A alternation
   (``benchmarks.overhead``). Figures: added TTFT p50/p99, requests/s, streamed tokens/s,
   gateway CPU time per request, and the gateway core issue's targets.
2. Balancing: 4 simulated vLLM replicas on the calibrated ``llama3-8b-a100`` profile, one
   gateway worker per policy, the same seeded open-loop workload for each: 480 requests,
   85% short (50-300 prompt tokens, 20-120 output) and 15% long (3,000-6,000 prompt, 300-800
   output), Poisson arrivals at 40/s: 3.5 times what one replica can serve on this mix
   (~11.5/s), about 85% of the four. least_outstanding_tokens vs least_requests vs
   round_robin, in alternating order over ``--rounds``. Figures, medians over rounds: TTFT
   p50/p99 (all and short requests), output tokens/s, time to finish the set. With ``--speed X`` the replicas' clock
   runs X times faster and figures are reported in simulated time (wall x X); the default 1
   keeps the shared CPU's scheduling noise out of the comparison.

Writes ``suite.json`` (every figure, the machine, the command) and ``suite.md`` (tables) into
--out. Every phase is bounded in time and every request has a timeout.
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
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from benchmarks import overhead
from gateway.bench.loadgen import Request, Target, open_loop, poisson_arrivals
from benchmarks.harness import (HOST, Scenario, fmt, free_port, machine_info, measure, pin_client,
                                replica_and_gateway, start, stop, wait_ready)
from gateway.bench.report import summarize_records
from gateway.bench.workload import synthetic_prompt

OVERHEAD_SCENARIOS = [
    Scenario(f"{'stream' if stream else 'plain'}_c{c}",
             f"{'stream, 256 tokens' if stream else 'non-stream, 16 tokens'}, c={c}",
             stream, c, 256 if stream else 16)
    for stream in (False, True) for c in (1, 64, 256)
]

POLICIES = ("least_outstanding_tokens", "least_requests", "round_robin")
MODEL = "llama-3-8b-sim"
REPLICAS = 4
PROFILE = "llama3-8b-a100"
TARGET_P99_GAIN = 0.30   # least_outstanding_tokens beats round_robin on TTFT p99 by this much


# ---------------------------------------------------------------------------------------------
# Balancing workload

def heterogeneous_requests(n: int, seed: int) -> list[Request]:
    """85% short, 15% long (prompt and output), in a seeded order."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            prompt, output, tag = rng.randint(3000, 6000), rng.randint(300, 800), "long"
        else:
            prompt, output, tag = rng.randint(50, 300), rng.randint(20, 120), "short"
        out.append(Request(prompt=synthetic_prompt(prompt, rng), max_tokens=output, tag=tag))
    return out


@contextlib.contextmanager
def replicas(n: int, speed: float, tmp: Path) -> Iterator[list[str]]:
    from gateway.sim.model_dir import builtin_model_dir
    procs, urls = [], []
    try:
        for i in range(n):
            port = free_port()
            procs.append(start(["sim", "--dialect", "vllm", "--port", str(port), "--model", MODEL,
                                "--max-model-len", "8192", "--profile", PROFILE,
                                "--speed", str(speed), "--tokenizer", str(builtin_model_dir())],
                               None, tmp / f"replica{i}.log"))
            urls.append(f"http://{HOST}:{port}")
        for url, proc in zip(urls, procs):
            wait_ready(url + "/health", proc)
        yield urls
    finally:
        for proc in procs:
            stop(proc)


@contextlib.contextmanager
def gateway(urls: list[str], balancer: str, tmp: Path) -> Iterator[str]:
    from gateway.sim.model_dir import builtin_model_dir
    port = free_port()
    config = tmp / f"gateway-{balancer}.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "models": [{"name": MODEL, "tokenizer": str(builtin_model_dir()), "max_model_len": 8192,
                    "replicas": [{"url": u, "engine": "vllm", "name": f"gpu{i}"}
                                 for i, u in enumerate(urls)]}],
        "balancer": balancer}))
    proc = start(["serve", "--config", str(config), "--port", str(port),
                  "--log-level", "warning"], None, tmp / f"gateway-{balancer}.log")
    try:
        wait_ready(f"http://{HOST}:{port}/ready", proc)
        yield f"http://{HOST}:{port}"
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway ({balancer}) died during the run; see {tmp}")
    finally:
        stop(proc)


def wait_idle(urls: list[str], timeout: float = 60.0) -> None:
    """Until no replica runs or queues a sequence (the last run's aborts included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for url in urls:
            with urllib.request.urlopen(url + "/sim/state", timeout=5) as r:
                states.append(json.load(r))
        if all(s["running"] == 0 and s["waiting"] == 0 for s in states):
            return
        time.sleep(0.2)
    raise TimeoutError("replicas still busy after the previous run")


def balancing(speed: float, rate: float, n: int, rounds: int, seed: int,
              tmp: Path) -> dict[str, Any]:
    """Every policy on the same workload, in alternating order; figures in simulated time.

    Each figure is the median over rounds: on a shared machine one round can be starved of
    CPU, and a median of rounds (unlike a pooled p99) does not let that round decide."""
    requests = heterogeneous_requests(n, seed)
    arrivals = [t / speed for t in poisson_arrivals(rate, n, seed=seed)]
    per_round: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    order: list[str] = []
    with replicas(REPLICAS, speed, tmp) as urls:
        for r in range(rounds):
            for policy in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
                wait_idle(urls)
                with gateway(urls, policy, tmp) as url:
                    target = Target(url, stream=True, model=MODEL)
                    run = asyncio.run(open_loop(target, requests, arrivals, timeout=120,
                                                rate=rate * speed))
                wall = max(x.end for x in run.records) - run.started
                figures = {tag or "all": simulated(summarize_records(
                    [x for x in run.records if not tag or x.tag == tag], wall), speed)
                    for tag in ("", "short", "long")}
                per_round[policy].append({**figures, "finish_s": round(wall * speed, 2)})
                order.append(policy)
                ttft = figures["all"].get("ttft_ms") or {}  # none when every request failed
                print(f"  balancing round {r + 1} {policy:25s} TTFT p50 {ttft.get('p50')} "
                      f"p99 {ttft.get('p99')} ms (simulated), errors "
                      f"{figures['all']['errors']}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"order": order, "policies": {}}
    for policy, runs in per_round.items():
        out["policies"][policy] = {
            "median": round_medians(runs),
            "errors": sum(sum(x["all"]["errors"].values()) for x in runs),
            "rounds": runs}
    lot = out["policies"]["least_outstanding_tokens"]["median"]["ttft_p99_ms"]
    rr = out["policies"]["round_robin"]["median"]["ttft_p99_ms"]
    out["lot_vs_round_robin_ttft_p99_gain"] = round(1 - lot / rr, 3) if lot and rr else None
    return out


def round_medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The headline figures of a policy: medians over its rounds (a round whose requests all
    failed has no TTFT and is left out of those)."""
    def median(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    def ttft(group: str, q: str) -> float | None:
        return median([(x[group].get("ttft_ms") or {}).get(q) for x in runs])

    return {"ttft_p50_ms": ttft("all", "p50"), "ttft_p99_ms": ttft("all", "p99"),
            "short_ttft_p50_ms": ttft("short", "p50"), "short_ttft_p99_ms": ttft("short", "p99"),
            "output_tokens_per_s": median([x["all"].get("output_tokens_per_s") for x in runs]),
            "finish_s": median([x["finish_s"] for x in runs])}


def simulated(summary: dict[str, Any], speed: float) -> dict[str, Any]:
    """Wall-clock figures -> simulated ones (times x speed, rates / speed)."""
    out = dict(summary)
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        if key in out:
            out[key] = {k: (round(v * speed, 3) if isinstance(v, float) and k != "samples" else v)
                        for k, v in out[key].items()}
    for key in ("requests_per_s", "output_tokens_per_s"):
        if out.get(key) is not None:
            out[key] = round(out[key] / speed, 2)
    out["wall_s"] = round(out["wall_s"] * speed, 2)
    return out


def balancing_table(res: dict[str, Any]) -> str:
    f = fmt
    rows = ["| policy | TTFT p50 / p99 ms | short requests TTFT p50 / p99 ms | output tok/s "
            "| time to finish the set s | TTFT p99 ms of each round | errors |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for policy, p in res["policies"].items():
        m = p["median"]
        each = ", ".join(f((x["all"].get("ttft_ms") or {}).get("p99")) for x in p["rounds"])
        rows.append(f"| {policy} | {f(m['ttft_p50_ms'])} / {f(m['ttft_p99_ms'])} "
                    f"| {f(m['short_ttft_p50_ms'])} / {f(m['short_ttft_p99_ms'])} "
                    f"| {f(m['output_tokens_per_s'])} | {f(m['finish_s'], 1)} | {each} "
                    f"| {p['errors']} |")
    gain = res["lot_vs_round_robin_ttft_p99_gain"]
    rows += ["", "Medians over rounds. least_outstanding_tokens vs round_robin, TTFT p99: "
             f"{'n/a' if gain is None else f'{100 * gain:.0f}% lower'} (target ≥ "
             f"{100 * TARGET_P99_GAIN:.0f}%: {'met' if gain is not None and gain >= TARGET_P99_GAIN else 'NOT met'})"]
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="directory for suite.json and suite.md (default results/)")
    parser.add_argument("--overhead-seconds", type=float, default=3.0,
                        help="measured seconds per overhead scenario and target (default 3)")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="simulated clock speed of the balancing replicas (default 1)")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="balancing arrivals, requests per simulated second (default 40)")
    parser.add_argument("--requests", type=int, default=480,
                        help="balancing requests per policy and round (default 480)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="balancing rounds; figures are medians over rounds (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip", choices=("overhead", "balancing"), action="append", default=[],
                        help="leave a part out")
    args = parser.parse_args(argv)
    if not (0 < args.overhead_seconds <= 30 and 0 < args.speed <= 20 and 0 < args.rate <= 200
            and 1 <= args.requests <= 5000 and 1 <= args.rounds <= 6):
        parser.error("out of bounds: --overhead-seconds (0, 30], --speed (0, 20], "
                     "--rate (0, 200], --requests [1, 5000], --rounds [1, 6]")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gw-suite-"))
    started = time.time()
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, "-m", "benchmarks.suite",
                             *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "machine": machine_info(),
        # Other work on a shared machine shows here: 1-minute load averages at start and end.
        "load_average": {"start": os.getloadavg()[0]}}
    pin_client()
    if "overhead" not in args.skip:
        print("overhead: direct vs through one gateway worker", file=sys.stderr, flush=True)
        with replica_and_gateway("--profile instant") as (ports, pids, _):
            result["overhead"] = asyncio.run(measure(
                ports, pids, args.overhead_seconds, 2, OVERHEAD_SCENARIOS))
    if "balancing" not in args.skip:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the balancing part is not pinned
        print(f"balancing: {REPLICAS} x {PROFILE} at speed {args.speed:g}, {args.requests} "
              f"requests at {args.rate:g}/s (simulated), {args.rounds} rounds", file=sys.stderr,
              flush=True)
        result["balancing"] = {"setup": {"replicas": REPLICAS, "profile": PROFILE,
                                         "speed": args.speed, "rate_per_sim_s": args.rate,
                                         "requests": args.requests, "rounds": args.rounds,
                                         "seed": args.seed},
                               **balancing(args.speed, args.rate, args.requests, args.rounds,
                                           args.seed, tmp)}
    result["elapsed_s"] = round(time.time() - started, 1)
    result["load_average"]["end"] = os.getloadavg()[0]
    (args.out / "suite.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    md = [f"# llm-gateway benchmark suite, {result['started']}", "",
          f"{m['nproc']} cores, {m['cpu_model']}, Python {m['python']}; "
          f"`{result['command']}`; {result['elapsed_s']:.0f} s; load average "
          f"{result['load_average']['start']:.1f} at start, {result['load_average']['end']:.1f} "
          "at end", ""]
    if "overhead" in result:
        md += ["## Overhead: direct vs through one gateway worker (`instant` replica)", "",
               overhead.table(result["overhead"]), ""]
    if "balancing" in result:
        b = result["balancing"]["setup"]
        md += [f"## Balancing: {b['replicas']} x `{b['profile']}`, {b['requests']} requests at "
               f"{b['rate_per_sim_s']:g}/s, 15% long (simulated time; clock x{b['speed']:g})", "",
               balancing_table(result["balancing"]), ""]
    (args.out / "suite.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"JSON: {args.out / 'suite.json'}  markdown: {args.out / 'suite.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
