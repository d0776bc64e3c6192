"""Routers at saturation under wrk: CPU per request and requests/s per core, side by side.

    python -m benchmarks.saturation [--seconds S] [--rounds N] [--connections C]
                                    [--peers vllm-router nginx] [--baseline CHECKOUT]
                                    [--profile-dir DIR] [--out FILE.json]

The Python load generator of ``benchmarks.overhead`` does not saturate a Rust router (in one
measurement vllm-router was busy 0.53 of its core), so ratios taken with it flatter the
slower router. Here an independent C load generator, wrk (Debian: ``apt-get install wrk``),
drives each router in turn with non-streaming ``/v1/completions`` (max_tokens 16) over C
keep-alive connections: the router on core 0; wrk and the backend on core 1. The backend is
nginx answering a fixed completion (with its usage) from memory, so that it, not a simulated
engine in Python, is never what limits the routers. Per router and round: requests/s (wrk), the router's CPU seconds
(its whole process tree, /proc), hence CPU per request and requests/s per core (requests/s
over the share of its core it used). Rounds alternate the routers' order. With
``--profile-dir`` the gateway is then sampled with py-spy under the same wrk load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks.harness import (CLIENT_CORE, HOST, MODEL, PEERS, free_port, machine_info,
                                peer_unavailable, routers_in_front_of, stop, summarise_raw,
                                tree_cpu_seconds, wait_ready)

BODY = json.dumps({"model": MODEL, "prompt": "Hello there, how are you", "max_tokens": 16})
SCRIPT = f"""wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
"""


ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "text": " I am fine, thank you for asking, and",
                                  "logprobs": None, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 7, "total_tokens": 23, "completion_tokens": 16}})
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                 "max_model_len": 4096}]})


@contextlib.contextmanager
def static_backend() -> Iterator[int]:
    """nginx on the client's core answering /v1/completions, /v1/models and /health from
    memory; yields its port."""
    tmp = Path(tempfile.mkdtemp(prefix="wrk-backend-"))
    port = free_port()
    quote = lambda text: text.replace("\\", "\\\\").replace("'", "\\'")  # noqa: E731
    (tmp / "nginx.conf").write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  keepalive_requests 1000000;
  server {{
    listen {HOST}:{port};
    default_type application/json;
    location = /v1/completions {{ return 200 '{quote(ANSWER)}'; }}
    location = /v1/models {{ return 200 '{quote(MODELS)}'; }}
    location = /health {{ return 200 ''; }}
  }}
}}
""")
    cmd = ["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(CLIENT_CORE), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_ready(f"http://{HOST}:{port}/health", proc)
        yield port
    finally:
        stop(proc)


def wrk(port: int, seconds: float, connections: int, script: Path) -> dict[str, float]:
    """One wrk run against ``port``, on the client's core: requests, errors, requests/s."""
    # wrk takes whole seconds only ("-d10.5s" prints its usage and runs nothing)
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{math.ceil(seconds)}s", "--latency", "-s", str(script),
           f"http://{HOST}:{port}/v1/completions"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(CLIENT_CORE), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30).stdout
    requests = re.search(r"(\d+) requests in", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), "
                              r"timeout (\d+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    if requests is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    return {"requests": float(requests.group(1)),
            "non_2xx": float(errors.group(1)) if errors else 0.0,
            "socket_errors": float(sum(int(g) for g in socket_errors.groups())) if socket_errors else 0.0,
            "latency_p50_ms": float(p50.group(1)) * scale[p50.group(2)] if p50 else float("nan")}


def measure(ports: dict[str, int], pids: dict[str, int], routers: list[str], seconds: float,
            rounds: int, connections: int, script: Path) -> dict[str, Any]:
    per: dict[str, list[dict[str, float]]] = {r: [] for r in routers}
    for i in range(rounds):
        for router in (routers if i % 2 == 0 else routers[::-1]):
            wrk(ports[router], 1.0, connections, script)  # warm-up: connections, caches
            cpu0, t0 = tree_cpu_seconds(pids[router]), time.monotonic()
            run = wrk(ports[router], seconds, connections, script)
            cpu, wall = tree_cpu_seconds(pids[router]) - cpu0, time.monotonic() - t0
            rps = run["requests"] / seconds
            busy = cpu / wall
            per[router].append({**run, "requests_per_s": rps, "core_busy": busy,
                                "cpu_us_per_request": cpu / run["requests"] * 1e6,
                                "requests_per_s_per_core": rps / busy if busy else float("nan")})
            print(f"  round {i + 1} {router}: {rps:,.0f} req/s, core busy {busy:.2f}, "
                  f"{per[router][-1]['cpu_us_per_request']:.0f} us CPU per request",
                  file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for router, runs in per.items():
        out[router] = {"rounds": runs, **{
            key: {"median": statistics.median(r[key] for r in runs),
                  "min": min(r[key] for r in runs), "max": max(r[key] for r in runs)}
            for key in ("requests_per_s", "core_busy", "cpu_us_per_request",
                        "requests_per_s_per_core")}}
    return out


def ratios(results: dict[str, Any], against: str) -> dict[str, dict[str, float]]:
    """Per round (same round, same order position) and median: ours over ``against``."""
    ours = results["gateway"]["rounds"]
    theirs = results[against]["rounds"]
    cpu = [a["cpu_us_per_request"] / b["cpu_us_per_request"] for a, b in zip(ours, theirs)]
    rps = [a["requests_per_s_per_core"] / b["requests_per_s_per_core"]
           for a, b in zip(ours, theirs)]
    return {"cpu_per_request": {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)},
            "requests_per_s_per_core": {"median": statistics.median(rps), "min": min(rps),
                                        "max": max(rps)}}


def profile(port: int, pid: int, seconds: float, connections: int, script: Path,
            directory: Path) -> dict[str, Any]:
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    directory.mkdir(parents=True, exist_ok=True)
    raw = directory / "gateway-wrk.raw"
    spy = subprocess.Popen([pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                            "--rate", "200", "--nonblocking", "--format", "raw", "-o", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.3)
    wrk(port, seconds + 0.5, connections, script)
    spy.communicate(timeout=60)
    return {"raw": str(raw), **(summarise_raw(raw) if raw.exists() else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.saturation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per router and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--peers", nargs="*", choices=PEERS, metavar="PEER",
                        help=f"routers beside the gateway ({', '.join(PEERS)}; bare: every one "
                             f"installed)")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also the gateway of this other checkout, in the same rotation")
    parser.add_argument("--profile-dir", type=Path, help="then py-spy the gateway under wrk")
    parser.add_argument("--out", default="saturation.json")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        parser.error("wrk not found (Debian: apt-get install wrk)")
    if not (0 < args.seconds <= 60 and 1 <= args.rounds <= 10):
        parser.error("--seconds must be in (0, 60] and --rounds in [1, 10]")
    wanted = PEERS if args.peers == [] else tuple(args.peers or ())
    missing = {p: why for p in wanted if (why := peer_unavailable(p))}
    if args.peers and missing:
        parser.error("; ".join(missing.values()))
    peers = tuple(p for p in wanted if p not in missing)
    script = Path(tempfile.mkdtemp(prefix="wrk-")) / "post.lua"
    script.write_text(SCRIPT)
    if shutil.which("nginx") is None:
        parser.error("nginx not found (Debian: apt-get install nginx-light): it is the backend")
    with static_backend() as backend, \
            routers_in_front_of(backend, peers, 1, args.baseline) as (ports, pids, _):
        routers = ["gateway", *(["baseline"] if args.baseline else []), *peers]
        results = measure(ports, pids, routers, args.seconds, args.rounds, args.connections,
                          script)
        prof = (profile(ports["gateway"], pids["gateway"], 10.0, args.connections, script,
                        args.profile_dir) if args.profile_dir else None)
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.saturation", *(argv or sys.argv[1:])]),
        "machine": machine_info(), "connections": args.connections, "results": results,
        "ratios": {p: ratios(results, p) for p in routers if p != "gateway"}}
    if prof is not None:
        report["profile"] = prof
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("\n| router | req/s | core busy | CPU us/request | req/s per core |\n|---|---:|---:|---:|---:|")
    for router in routers:
        r = results[router]
        print(f"| {router} | {r['requests_per_s']['median']:,.0f} | {r['core_busy']['median']:.2f} "
              f"| {r['cpu_us_per_request']['median']:.0f} "
              f"| {r['requests_per_s_per_core']['median']:,.0f} |")
    for against, q in report["ratios"].items():
        c, s = q["cpu_per_request"], q["requests_per_s_per_core"]
        print(f"gateway / {against}: CPU per request {c['median']:.2f} ({c['min']:.2f}-"
              f"{c['max']:.2f}), requests/s per core {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
    if prof is not None and "top_self_pct" in prof:
        print("\nprofile under wrk (self share):")
        for frame, share in prof["top_self_pct"][:15]:
            print(f"  {share:5.1f}%  {frame}")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
