"""What metrics cost on the hot path: one gateway worker with metrics on vs one with them off.

    python -m benchmarks.metrics_cost [--duration S] [--out FILE.json]

One simulated vLLM replica (``--profile instant``) and two gateways in front of it, identical
but for ``metrics: false`` in one config; both gateways pinned to core 0 (only one is loaded
at a time), replica and load generator on core 1. Each scenario alternates on / off / off / on
so drift cancels out; the load generator and measurement are ``benchmarks.harness``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from benchmarks.harness import (CLIENT_CORE, GATEWAY_CORE, HOST, MODEL, REPLICA_CORE, Scenario,
                                free_port, run_segment, start, stop, summarise, wait_ready)

SCENARIOS = [
    Scenario("tps_c64", "stream tokens/s, c=64, max_tokens 256", True, 64, 256),
    Scenario("rps_c64", "non-stream req/s, c=64, max_tokens 16", False, 64, 16),
]


async def measure(ports: dict[str, int], pids: dict[str, int], per_target: float,
                  rounds: int, targets: tuple[str, ...] = ("on", "off")) -> dict[str, Any]:
    """Each scenario on each target gateway, in turn: ``targets`` in order, then reversed,
    and so on for ``rounds`` (drift cancels out)."""
    out: dict[str, Any] = {}
    for sc in SCENARIOS:
        segments: dict[str, list] = {t: [] for t in targets}
        for r in range(rounds):
            for target in (targets if r % 2 == 0 else targets[::-1]):
                segments[target].append(await run_segment(ports[target], sc, per_target / rounds,
                                                          {"gateway": pids[target]}))
        out[sc.key] = {"scenario": sc.__dict__,
                       **{t: summarise(segments[t], sc, router="gateway") for t in segments}}
    return out


@contextlib.contextmanager
def gateways(configs: dict[str, dict[str, Any]], tmp: Path,
             checkouts: dict[str, Path] | None = None
             ) -> Iterator[tuple[dict[str, int], dict[str, int]]]:
    """One simulated vLLM replica (core 1) and a gateway per ``configs`` entry in front of it
    (core 0; each config's keys added to the model's), from ``checkouts[target]`` where given;
    yields their ports and pids. All are stopped on exit."""
    rport = free_port()
    procs = []
    try:
        replica = start(["sim", "--dialect", "vllm", "--profile", "instant", "--port", str(rport),
                         "--model", MODEL, "--max-model-len", "4096"], REPLICA_CORE,
                        tmp / "replica.log")
        procs.append(replica)
        wait_ready(f"http://{HOST}:{rport}/health", replica)
        ports, pids = {}, {}
        for target, extra in configs.items():
            config = tmp / f"gateway-{target}.yaml"
            config.write_text(json.dumps({**extra, "models": [
                {"name": MODEL, "replicas": [{"url": f"http://{HOST}:{rport}", "engine": "vllm"}]}]}))
            ports[target] = free_port()
            gateway = start(["serve", "--config", str(config), "--port", str(ports[target]),
                             "--log-level", "warning"], GATEWAY_CORE, tmp / f"gateway-{target}.log",
                            **({"checkout": checkouts[target]} if checkouts and target in checkouts
                               else {}))
            procs.append(gateway)
            wait_ready(f"http://{HOST}:{ports[target]}/ready", gateway)
            pids[target] = gateway.pid
        yield ports, pids
    finally:
        for proc in reversed(procs):
            stop(proc)


def table(res: dict[str, Any]) -> str:
    rows = ["| one gateway worker | metrics on | metrics off | on / off |", "|---|---:|---:|---:|"]
    for key, figure, unit in [("tps_c64", "tokens_per_s", "streamed tokens/s, c=64, 256 tok"),
                              ("rps_c64", "requests_per_s", "non-stream req/s, c=64, 16 tok")]:
        on, off = res[key]["on"][figure], res[key]["off"][figure]
        rows.append(f"| {unit} | {on:,.0f} | {off:,.0f} | {on / off:.3f} |")
        cpu = "router_cpu_us_per_token" if key == "tps_c64" else "router_cpu_us_per_request"
        on_cpu, off_cpu = res[key]["on"].get(cpu), res[key]["off"].get(cpu)
        if on_cpu and off_cpu:
            rows.append(f"| gateway CPU {'per token' if key == 'tps_c64' else 'per request'} "
                        f"(µs) | {on_cpu:.2f} | {off_cpu:.2f} | {on_cpu / off_cpu:.3f} |")
    return "\n".join(rows)


def side_by_side_parser(driver: str, doc: str) -> argparse.ArgumentParser:
    """The options every side-by-side cost driver takes (--duration, --rounds, --out)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{driver}",
                                     description=doc.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0,
                        help="measured seconds per scenario and gateway (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations (default 2)")
    parser.add_argument("--out", default=f"{driver.replace('_', '-')}.json",
                        help="JSON results file")
    return parser


def parse_side_by_side(parser: argparse.ArgumentParser,
                       argv: list[str] | None) -> argparse.Namespace:
    """Checked arguments; this process (the load generator) moves to the client core."""
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 60 or not 1 <= args.rounds <= 10:
        parser.error("--duration must be in (0, 60] and --rounds in [1, 10]")
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {CLIENT_CORE})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_side_by_side(side_by_side_parser("metrics_cost", __doc__), argv)
    tmp = Path(tempfile.mkdtemp(prefix="gw-metrics-cost-"))
    with gateways({"on": {"metrics": True}, "off": {"metrics": False}}, tmp) as (ports, pids):
        res = asyncio.run(measure(ports, pids, args.duration, args.rounds))
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
