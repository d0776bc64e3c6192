"""What shadow traffic costs the clients: client latency with shadowing off and on, one run.

    python -m benchmarks.shadow [--seconds S] [--rounds R] [--users U] [--out FILE.json]

Starts, on loopback, the primary's simulated vLLM replica (paced: ``--ttft-ms 20
--itl-ms 5``), a shadow replica like it, a slow one (TTFT 2 s, 100 ms between tokens), and
four gateways in front of the same primary replica: ``off`` (no shadow pool), ``on`` (a
shadow pool of the like replica, ``sample: 1.0``), ``slow`` (the slow replica shadows every
request) and ``down`` (the shadow pool's replica does not listen). Segments of S seconds
alternate over the four (A B C D, then D C B A, ... so drift cancels out), each a closed loop
of U users streaming ``/v1/completions`` (max_tokens 16). Reports the client's TTFT and e2e
latency per gateway and their ratios to ``off``, per round (the spread) and overall; the
clients of a shadowed gateway should see no difference. Every phase is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.bench.loadgen import Request, Target, closed_loop
from benchmarks.harness import HOST, free_port, start, stop, wait_ready
from gateway.bench.report import distribution_ms

MODEL = "m"
PACED = ["--profile", "paced", "--ttft-ms", "20", "--itl-ms", "5"]
SLOW = ["--profile", "paced", "--ttft-ms", "2000", "--itl-ms", "100"]
CONFIGS = ("off", "on", "slow", "down")


def _config(primary: str, shadow: str | None) -> dict[str, Any]:
    pools: list[dict[str, Any]] = [{"name": "stable", "replicas": [{"url": primary,
                                                                    "name": "primary"}]}]
    if shadow is not None:
        pools.append({"name": "shadow", "shadow_of": "stable", "sample": 1.0,
                      "replicas": [{"url": shadow, "name": "shadow"}]})
    return {"models": [{"name": MODEL, "pools": pools}], "health": {"interval": 1.0}}


def _start_sim(tmp: Path, name: str, args: list[str], procs: list) -> str:
    port = free_port()
    proc = start(["sim", "--dialect", "vllm", "--port", str(port), "--model", MODEL,
                  "--max-model-len", "4096", *args], None, tmp / f"{name}.log")
    procs.append(proc)
    wait_ready(f"http://{HOST}:{port}/health", proc)
    return f"http://{HOST}:{port}"


async def _segment(url: str, users: int, seconds: float) -> tuple[list[float], list[float], int]:
    target = Target(url + "/v1/completions", stream=True, model=MODEL)
    requests = [Request(prompt=f"shadow bench {i}", max_tokens=16) for i in range(64)]
    run = await closed_loop(target, requests, users, duration=seconds, timeout=30.0)
    ok = [r for r in run.records if r.ok]
    return ([r.ttft for r in ok if r.ttft is not None], [r.e2e for r in ok],
            len(run.records) - len(ok))


def measure(urls: dict[str, str], users: int, seconds: float, rounds: int) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {c: [] for c in urls}
    e2e: dict[str, list[float]] = {c: [] for c in urls}
    failed = dict.fromkeys(urls, 0)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = list(urls) if r % 2 == 0 else list(reversed(urls))
        medians = {}
        for config in order:
            t, e, f = asyncio.run(_segment(urls[config], users, seconds))
            ttft[config] += t
            e2e[config] += e
            failed[config] += f
            medians[config] = statistics.median(t) if t else float("nan")
        per_round.append({c: medians[c] / medians["off"] for c in urls if c != "off"})
        print(f"round {r + 1}: TTFT p50 ratio to off " + ", ".join(
            f"{c} {v:.3f}" for c, v in per_round[-1].items()), file=sys.stderr, flush=True)
    result: dict[str, Any] = {"users": users, "seconds_per_segment": seconds, "rounds": rounds,
                              "configs": {}, "ttft_p50_ratio_per_round": per_round}
    base_t = statistics.median(ttft["off"])
    base_e = statistics.median(e2e["off"])
    for config in urls:
        result["configs"][config] = {
            "ttft_ms": distribution_ms(ttft[config]), "e2e_ms": distribution_ms(e2e[config]),
            "failed": failed[config],
            "ttft_p50_ratio": statistics.median(ttft[config]) / base_t,
            "e2e_p50_ratio": statistics.median(e2e[config]) / base_e}
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| gateway | requests | failed | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms "
             "| TTFT p50 / off | e2e p50 / off | TTFT ratio range over rounds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for config, c in result["configs"].items():
        spread = [r[config] for r in result["ttft_p50_ratio_per_round"] if config in r]
        span = f"{min(spread):.3f}-{max(spread):.3f}" if spread else "-"
        lines.append(f"| {config} | {c['e2e_ms']['samples'] + c['failed']} | {c['failed']} "
                     f"| {c['ttft_ms']['p50']} | {c['ttft_ms']['p99']} | {c['e2e_ms']['p50']} "
                     f"| {c['e2e_ms']['p99']} | {c['ttft_p50_ratio']:.3f} "
                     f"| {c['e2e_p50_ratio']:.3f} | {span} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shadow",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per segment (default 5)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds over the four gateways "
                        "(default 4)")
    parser.add_argument("--users", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.users < 1:
        parser.error("--seconds, --rounds and --users must be positive")
    tmp = Path(tempfile.mkdtemp(prefix="gw-shadow-bench-"))
    procs: list = []
    try:
        primary = _start_sim(tmp, "primary", PACED, procs)
        shadows = {"off": None, "on": _start_sim(tmp, "shadow", PACED, procs),
                   "slow": _start_sim(tmp, "slow", SLOW, procs),
                   "down": f"http://{HOST}:{free_port()}"}
        urls = {}
        for config in CONFIGS:
            path = tmp / f"{config}.yaml"
            path.write_text(json.dumps(_config(primary, shadows[config])))
            port = free_port()
            proc = start(["serve", "--config", str(path), "--port", str(port),
                          "--log-level", "warning"], None, tmp / f"gateway-{config}.log")
            procs.append(proc)
            wait_ready(f"http://{HOST}:{port}/ready", proc)
            urls[config] = f"http://{HOST}:{port}"
        result = measure(urls, args.users, args.seconds, args.rounds)
    finally:
        for proc in reversed(procs):
            stop(proc)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
