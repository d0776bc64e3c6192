"""Measure the overhead the gateway adds, side by side with the replica it fronts.

    python -m benchmarks.overhead [--duration S] [--out FILE.json] [--profile-dir DIR]
                                     [--peers [vllm-router nginx envoy envoy-epp envoy-null]]
                                     [--paced] [--workers N]
                                     [--baseline CHECKOUT]

Starts, on loopback, one simulated vLLM replica (``--profile instant``: it answers with no
delay, so what remains is HTTP + relay cost) pinned to core 1 and one gateway worker in
front of it pinned to core 0; the load generator runs on core 1 too. Then, for each scenario,
it measures the replica directly and through the gateway alternately (A B B A, so drift
cancels out) with a closed loop of C users of the load generator (``gateway.bench.loadgen``:
a minimal HTTP/1.1 keep-alive client on asyncio protocols, cheaper than any client library, so
it is not the bottleneck):

- streaming ``/v1/completions`` TTFT (request written -> first token event read)
  p50/p99 at concurrency 1 and 64, max_tokens 16;
- non-streaming ``/v1/completions`` requests/s at concurrency 64, max_tokens 16, with the
  gateway's CPU time per request (``/proc/<pid>/stat`` utime+stime);
- streamed tokens/s (token events read inside the window) at concurrency 64 and 256,
  max_tokens 256.

With ``--peers`` the same replica is also fronted by peer routers, each measured in the same
rotation, on the gateway's core, with its CPU time charged the same way (its whole process
tree): vllm-router (Rust, from PyPI, in its own venv ``$BENCH_VENV``) and nginx (C) where
installed, so every run reports our cost as a ratio to theirs; ``envoy`` (Envoy alone, least
request) and ``envoy-epp`` (the same Envoy asking this project's endpoint picker,
``llm-gateway epp``, for each request: both processes charged, the picker's own CPU shown
too), so the picker's cost shows against Envoy alone and against the gateway
(``BENCH_PROFILE_PICKER=FILE``: the picker runs under cProfile, its stats written to FILE
when it stops); ``envoy-null`` (the same Envoy asking ``benchmarks.null_processor``, an
ext_proc server that decides nothing): what the exchange costs Envoy itself, and gRPC in
Python a server, whatever the picker decides. ``--paced`` makes the replica stream one
event per token, 10 ms apart, as real engines do, and measures TTFT at concurrency 1 and 256
paced streams: the CPU per relayed event.

With ``--baseline CHECKOUT`` the gateway of another checkout of this project (a git worktree
of ``main``, say) also runs in front of the same replica, on the same core, in the same
rotation: a change's cost measured side by side with the code before it, which on a noisy
machine separate runs cannot show.

The benchmark suite (``benchmarks.suite``) runs the same measurement on its own scenarios.

With ``--translation`` it compares instead, through the same gateway and replica, a stream
whose client speaks the replica's dialect (OpenAI ``/v1/completions``: bytes passed through)
with one translated (TGI ``/generate_stream`` on the vLLM replica), alternating, and reports
the gateway's CPU per streamed token event of each and their ratio. Run it with the paced
profile so events arrive one per read, as from a real engine
(``--sim-args '--profile paced --ttft-ms 10 --itl-ms 10'``).

It prints a markdown table and writes every figure plus machine info as JSON. With
``--profile-dir`` it then samples the gateway with py-spy (raw format, non-blocking) under a
non-streaming and a streaming load (or the ``--profile-scenarios`` named) and summarises
where its CPU time goes.
Every phase is bounded in time; every request has a timeout. The processes, the load and
the profile summaries are ``benchmarks.harness``'s, which the other drivers share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.harness import (BENCH_VENV, CLIENT_CORE, GATEWAY_CORE, PEERS, PICKER,
                                REPLICA_CORE, WARMUP, Scenario, Segment, fmt, machine_info,
                                measure, peer_unavailable, pin_client, replica_and_gateway,
                                run_segment, summarise, summarise_raw)

# Targets of the issue (per gateway core).
TARGET_RPS = 2000.0
TARGET_TOKENS_PER_S = 40000.0
TARGET_ADDED_TTFT_P50_MS = 1.0


SCENARIOS = [
    Scenario("ttft_c1", "stream TTFT, c=1, max_tokens 16", True, 1, 16),
    Scenario("ttft_c64", "stream TTFT, c=64, max_tokens 16", True, 64, 16),
    Scenario("rps_c64", "non-stream req/s, c=64, max_tokens 16", False, 64, 16),
    Scenario("tps_c64", "stream tokens/s, c=64, max_tokens 256", True, 64, 256),
    Scenario("tps_c256", "stream tokens/s, c=256, max_tokens 256", True, 256, 256),
]


# One event per token, 10 ms apart, as a real engine streams: where per-event cost shows.
PACED_SIM_ARGS = "--profile paced --ttft-ms 10 --itl-ms 10"
PACED_SCENARIOS = [
    Scenario("ttft_c1", "stream TTFT, c=1, max_tokens 16", True, 1, 16),
    Scenario("paced_c256", "paced stream, c=256, max_tokens 256", True, 256, 256),
]

TRANSLATION_SCENARIOS = [
    Scenario("stream_c16", "stream, c=16, max_tokens 256", True, 16, 256),
    Scenario("stream_c64", "stream, c=64, max_tokens 256", True, 64, 256),
]


async def measure_translation(port: int, pids: dict[str, int], per_target: float, rounds: int,
                              scenarios: list[Scenario] = TRANSLATION_SCENARIOS) -> dict[str, Any]:
    """Same-dialect (OpenAI client) vs translated (TGI client) streams through one gateway to
    one vLLM replica, alternating A B B A; the gateway's CPU per token event of each."""
    out: dict[str, Any] = {}
    for sc in scenarios:
        variants = {"passthrough": sc, "translated": Scenario(**{**sc.__dict__, "api": "tgi"})}
        segs: dict[str, list[Segment]] = {name: [] for name in variants}
        for r in range(rounds):
            for name in (("passthrough", "translated") if r % 2 == 0 else ("translated", "passthrough")):
                segs[name].append(await run_segment(port, variants[name], per_target / rounds, pids))
        res = {name: summarise(segs[name], variants[name], router="gateway") for name in variants}
        a, b = (res[k].get("router_cpu_us_per_token") for k in ("passthrough", "translated"))
        out[sc.key] = {"scenario": sc.__dict__, **res,
                       "cpu_per_token_ratio": b / a if a and b else None}
        print(f"  {sc.key}: gateway CPU per token event {a and round(a, 2)} µs passthrough, "
              f"{b and round(b, 2)} µs translated", file=sys.stderr, flush=True)
    return out




def translation_table(res: dict[str, Any]) -> str:
    f = fmt
    rows = ["| scenario | streamed tokens/s passthrough / translated | gateway CPU µs per token "
            "event, passthrough / translated | translated / passthrough | errors |",
            "|---|---:|---:|---:|---:|"]
    for r in res.values():
        p, t = r["passthrough"], r["translated"]
        rows.append(f"| {r['scenario']['what']} | {f(p['tokens_per_s'])} / {f(t['tokens_per_s'])} "
                    f"| {f(p.get('router_cpu_us_per_token'), 2)} / "
                    f"{f(t.get('router_cpu_us_per_token'), 2)} | {f(r['cpu_per_token_ratio'], 2)} "
                    f"| {p['errors']} / {t['errors']} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Report

def table(res: dict[str, Any]) -> str:
    """One row per scenario (direct | via gateway | added), the issue's targets, CPU use."""
    f = fmt

    def added(d: float | None, g: float | None) -> str:
        return "n/a" if d is None or g is None else f"{g - d:+,.3f}"

    rows = ["| scenario | TTFT¹ p50 ms direct / gateway (added) | TTFT¹ p99 ms direct / gateway "
            "(added) | req/s direct / gateway | streamed tok/s direct / gateway | gateway CPU "
            "µs / request |",
            "|---|---:|---:|---:|---:|---:|"]
    for key, r in res.items():
        d, g = r["direct"], r["gateway"]
        lat = "ttft_ms" if r["scenario"]["stream"] else "latency_ms"
        p50 = (d[lat]["p50"], g[lat]["p50"])
        p99 = (d[lat]["p99"], g[lat]["p99"])
        tok = (f"{f(d['tokens_per_s'])} / {f(g['tokens_per_s'])}" if "tokens_per_s" in d else "")
        rows.append(f"| {r['scenario']['what']} | {f(p50[0], 3)} / {f(p50[1], 3)} "
                    f"({added(*p50)}) | {f(p99[0], 3)} / {f(p99[1], 3)} ({added(*p99)}) "
                    f"| {f(d['requests_per_s'])} / {f(g['requests_per_s'])} | {tok} "
                    f"| {f(g.get('router_cpu_us_per_request'))} |")
    rows += ["", "¹ streams: to the first token; non-streaming: to the whole response.", ""]
    rows += targets(res)
    routers = [t for t in next(iter(res.values()))["order"] if t != "direct"]
    routers = list(dict.fromkeys(routers))
    if len(routers) > 1:
        rows += ["", "Peer routers in front of the same replica, same run:", "", peer_table(res)]
    if "envoy-epp" in routers:
        rows += ["", "Envoy + endpoint picker against Envoy alone and the gateway, same run:",
                 "", picker_table(res)]
    if "baseline" in routers:
        rows += ["", "This checkout's gateway against the baseline checkout's, same run:", "",
                 baseline_table(res)]
    rows += ["", "CPU busy during each window (cores; routers on core 0, replica + load "
             "generator on core 1):", "",
             "| scenario | target | router | replica | load generator |", "|---|---|---:|---:|---:|"]
    for key, r in res.items():
        for target in ("direct", *routers):
            u = r[target]["cpu_util"]
            router = 0.0 if target == "direct" else u.get(target, 0)
            rows.append(f"| {key} | {target} | {router:.2f} | "
                        f"{u.get('replica', 0):.2f} | {u.get('client', 0):.2f} |")
    return "\n".join(rows)


def peer_table(res: dict[str, Any]) -> str:
    """Every router side by side per scenario: what it carried, the TTFT it added, its CPU
    per request (non-stream) or per token event (streams), and that CPU as a ratio to
    vllm-router's measured in the same run."""
    f = fmt
    rows = ["| scenario | router | req/s | streamed tok/s | added TTFT¹ p50 ms | CPU µs per "
            "request | CPU µs per token event | CPU / vllm-router's |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res.values():
        sc = r["scenario"]
        lat = "ttft_ms" if sc["stream"] else "latency_ms"
        per = "router_cpu_us_per_token" if sc["stream"] else "router_cpu_us_per_request"
        base = r.get("vllm-router", {}).get(per)
        direct = r["direct"][lat]["p50"]
        for name, g in r.items():
            if name in ("scenario", "order", "direct"):
                continue
            added = None if direct is None or g[lat]["p50"] is None else g[lat]["p50"] - direct
            ratio = g.get(per) / base if base and g.get(per) else None
            rows.append(f"| {sc['what']} | {name} | {f(g['requests_per_s'])} "
                        f"| {f(g.get('tokens_per_s'))} | {f(added, 3)} "
                        f"| {f(g.get('router_cpu_us_per_request'), 1)} "
                        f"| {f(g.get('router_cpu_us_per_token'), 2)} | {f(ratio, 2)} |")
            for part, p in g.get("parts", {}).items():  # inside the row above, on its own
                ratio = p.get(per.removeprefix("router_")) / base if base else None
                rows.append(f"| {sc['what']} | {part} (its own CPU) | | | "
                            f"| {f(p['cpu_us_per_request'], 1)} "
                            f"| {f(p.get('cpu_us_per_token'), 2)} | {f(ratio, 2)} |")
    return "\n".join(rows)


def picker_table(res: dict[str, Any]) -> str:
    """Envoy + the endpoint picker against Envoy alone and against the gateway, per
    scenario: CPU per request (non-stream) or per token event (streams), the picker's own
    share, the ratios with each round's (their spread is the noise), and TTFT p50."""
    rows = ["| scenario | CPU µs per request or token event: envoy / envoy-epp (its picker) / "
            "gateway | envoy-epp / envoy, per round | envoy-epp / gateway, per round | "
            "TTFT¹ p50 ms: direct / envoy / envoy-epp / gateway |",
            "|---|---:|---|---|---:|"]
    for r in res.values():
        per = "token" if r["scenario"]["stream"] else "request"
        nd = 2 if per == "token" else 1
        epp = r["envoy-epp"]
        picker = epp.get("parts", {}).get(PICKER, {})

        def cpu(g: dict[str, Any]) -> float | None:
            return g.get(f"router_cpu_us_per_{per}")

        def ratio(other: str) -> str:
            if other not in r or not cpu(epp) or not cpu(r[other]):
                return "n/a"
            rounds = [a / b for a, b in zip(epp.get(f"round_cpu_us_per_{per}", []),
                                            r[other].get(f"round_cpu_us_per_{per}", []))
                      if a and b]
            return (f"{cpu(epp) / cpu(r[other]):.2f} "  # type: ignore[operator]
                    f"({', '.join(f'{x:.2f}' for x in rounds)})")

        lat = "ttft_ms" if r["scenario"]["stream"] else "latency_ms"
        p50 = " / ".join(fmt(r[t][lat]["p50"], 3) if t in r else "n/a"
                         for t in ("direct", "envoy", "envoy-epp", "gateway"))
        rows.append(f"| {r['scenario']['what']} | {fmt(cpu(r.get('envoy', {})), nd)} / "
                    f"{fmt(cpu(epp), nd)} ({fmt(picker.get(f'cpu_us_per_{per}'), nd)}) / "
                    f"{fmt(cpu(r['gateway']), nd)} | {ratio('envoy')} | {ratio('gateway')} "
                    f"| {p50} |")
    return "\n".join(rows)


def baseline_table(res: dict[str, Any]) -> str:
    """The gateway's CPU per request (non-stream) or per token event (streams) and its TTFT
    against the baseline checkout's, per scenario, with the ratio per round (its spread is
    the noise)."""
    rows = ["| scenario | CPU µs per request or token event, baseline → now | ratio | "
            "per round | TTFT¹ p50 ms, baseline → now |", "|---|---:|---:|---|---:|"]
    for r in res.values():
        before, now = r["baseline"], r["gateway"]
        per = "token" if r["scenario"]["stream"] else "request"
        a, b = before.get(f"router_cpu_us_per_{per}"), now.get(f"router_cpu_us_per_{per}")
        rounds = [y / x for x, y in zip(before.get(f"round_cpu_us_per_{per}", []),
                                        now.get(f"round_cpu_us_per_{per}", [])) if x and y]
        lat = "ttft_ms" if r["scenario"]["stream"] else "latency_ms"
        rows.append(f"| {r['scenario']['what']} | {fmt(a, 1 if per == 'request' else 2)} → "
                    f"{fmt(b, 1 if per == 'request' else 2)} "
                    f"| {fmt(b / a if a and b else None, 3)} "
                    f"| {', '.join(f'{x:.2f}' for x in rounds)} "
                    f"| {fmt(before[lat]['p50'], 3)} → {fmt(now[lat]['p50'], 3)} |")
    return "\n".join(rows)


def targets(res: dict[str, Any]) -> list[str]:
    """The gateway core issue's targets, against the best figure any scenario reached."""
    gw = [r["gateway"] for r in res.values()]
    rps = max((g.get("router_requests_per_core_s") or 0 for g, r in zip(gw, res.values())
               if not r["scenario"]["stream"]), default=0)
    tps = max((g.get("tokens_per_s") or 0 for g in gw), default=0)
    c1 = [r for r in res.values() if r["scenario"]["stream"] and r["scenario"]["concurrency"] == 1]
    ttft = None
    if c1 and c1[0]["direct"]["ttft_ms"]["p50"] is not None and c1[0]["gateway"]["ttft_ms"]["p50"] is not None:
        ttft = c1[0]["gateway"]["ttft_ms"]["p50"] - c1[0]["direct"]["ttft_ms"]["p50"]
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"
    return ["| target (one gateway core) | measured | |", "|---|---:|---|",
            f"| non-stream requests/s per busy core ≥ {TARGET_RPS:,.0f} | {rps:,.0f} "
            f"| {met(rps >= TARGET_RPS)} |",
            f"| streamed tokens/s through the gateway ≥ {TARGET_TOKENS_PER_S:,.0f} | {tps:,.0f} "
            f"| {met(tps >= TARGET_TOKENS_PER_S)} |",
            f"| added stream TTFT p50 at c=1 < {TARGET_ADDED_TTFT_P50_MS:g} ms | "
            f"{'n/a' if ttft is None else f'{ttft:.3f} ms'} "
            f"| {met(ttft is not None and ttft < TARGET_ADDED_TTFT_P50_MS)} |"]



def default_profiled(paced: bool) -> tuple[str, ...]:
    """The heaviest loads of the run: per request (non-stream) and per event (streams)."""
    return ("paced_c256",) if paced else ("rps_c64", "tps_c64")


async def profile(ports: dict[str, int], pids: dict[str, int], directory: Path,
                  seconds: float, paced: bool = False,
                  keys: Sequence[str] = ()) -> dict[str, Any]:
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    scenarios = PACED_SCENARIOS if paced else SCENARIOS
    for key in keys or default_profiled(paced):
        sc = next(s for s in scenarios if s.key == key)
        raw = directory / f"gateway-{key}.raw"
        svg = directory / f"gateway-{key}.svg"
        # Two recordings over the same load: raw (to summarise) and a flamegraph (to look at).
        procs = [subprocess.Popen([pyspy, "record", "--pid", str(pids["gateway"]),
                                   "--duration", str(int(seconds)), "--rate", "200",
                                   "--nonblocking", "--format", fmt, "-o", str(path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for fmt, path in (("raw", raw), ("flamegraph", svg))]
        await asyncio.sleep(0.3)
        seg = await run_segment(ports["gateway"], sc, seconds + 0.5, pids)
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                errs.append(err.decode(errors="replace")[-500:])
        entry: dict[str, Any] = {"raw": str(raw), "flamegraph": str(svg),
                                 "load_requests_per_s": seg.requests / seg.window,
                                 "load_tokens_per_s": seg.tokens / seg.window}
        if errs:
            entry["py_spy_errors"] = errs
        if raw.exists():
            entry.update(summarise_raw(raw))
        out[key] = entry
        print(f"  profiled {key}: {entry.get('samples', 0)} samples -> {svg}",
              file=sys.stderr, flush=True)
    return out


def profile_text(prof: dict[str, Any]) -> str:
    lines = []
    for key, p in prof.items():
        if not isinstance(p, dict) or "samples" not in p:
            lines.append(f"{key}: {p}")
            continue
        lines.append(f"\n### gateway profile under {key} ({p['samples']} samples, "
                     f"{p['load_requests_per_s']:.0f} req/s)\n")
        lines.append("group: self % (stdlib leaves charged to their caller's group) / "
                     "inclusive % (lower bound)")
        total = dict(p["group_total_pct"])
        for name, s in p["group_self_pct"]:
            lines.append(f"  {name:44s} {s:5.1f} / {total.get(name, 0):5.1f}")
        lines.append("top functions by self %:")
        for name, s in p["top_self_pct"][:15]:
            lines.append(f"  {s:5.1f}  {name}")
        lines.append("top functions by total %:")
        for name, s in p["top_total_pct"][:20]:
            lines.append(f"  {s:5.1f}  {name}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=6.0,
                        help="measured seconds per scenario and target (default 6; split "
                             "into --rounds alternating segments, each after a 0.5 s warm-up and its first completed request)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating segments per scenario: direct/gateway, then "
                             "gateway/direct, ... (default 2)")
    parser.add_argument("--out", default="overhead.json", help="JSON results file")
    parser.add_argument("--profile-dir", type=Path,
                        help="also profile the gateway with py-spy under load; write here")
    parser.add_argument("--profile-seconds", type=float, default=10.0)
    parser.add_argument("--profile-scenarios", nargs="+", metavar="KEY", default=(),
                        help="the scenarios to profile (default: rps_c64 tps_c64, or "
                             "paced_c256 with --paced; ttft_c1 for what a lone request "
                             "costs)")
    parser.add_argument("--translation", action="store_true",
                        help="compare same-dialect streams with translated ones (TGI clients on "
                             "the vLLM replica) through the gateway, instead of direct vs gateway")
    parser.add_argument("--peers", nargs="*", choices=PEERS, metavar="PEER",
                        help=f"also measure these routers in front of the same replica, in the "
                             f"same rotation ({', '.join(PEERS)}; bare --peers: every one "
                             f"installed; vllm-router from $BENCH_VENV, default {BENCH_VENV})")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also run the gateway of this other checkout (e.g. a git "
                             "worktree of main) in the same rotation: a change side by side "
                             "with the code before it")
    parser.add_argument("--paced", action="store_true",
                        help="one event per token, 10 ms apart, as real engines stream "
                             f"(replica '{PACED_SIM_ARGS}'): TTFT at c=1 and 256 paced streams")
    parser.add_argument("--workers", type=int, default=1,
                        help="gateway worker processes, all on the gateway's core (default "
                             "1): their CPU per request against one worker's shows what "
                             "more workers cost beyond the cores they take")
    parser.add_argument("--sim-args", default=None,
                        help="profile arguments of the simulated replica (default "
                             "'--profile instant'; e.g. '--profile paced --ttft-ms 10 "
                             "--itl-ms 10' for one event per token, as a real engine sends)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.duration > 60 or not 1 <= args.rounds <= 10:
        parser.error("--duration must be in (0, 60] and --rounds in [1, 10]")
    if args.sim_args is None:
        args.sim_args = PACED_SIM_ARGS if args.paced else "--profile instant"
    known = {sc.key for sc in (PACED_SCENARIOS if args.paced else SCENARIOS)}
    if unknown := set(args.profile_scenarios) - known:
        parser.error(f"--profile-scenarios: no scenario {', '.join(sorted(unknown))} in this "
                     f"run (known: {', '.join(sorted(known))})")
    peers: tuple[str, ...] = ()
    if args.peers is not None:
        wanted = args.peers or PEERS
        missing = {p: why for p in wanted if (why := peer_unavailable(p))}
        if args.peers and missing:  # named explicitly: it must run
            parser.error("; ".join(missing.values()))
        for why in missing.values():
            print(f"skipping a peer: {why}", file=sys.stderr)
        peers = tuple(p for p in wanted if p not in missing)

    pin_client()
    if not 1 <= args.workers <= 8:
        parser.error("--workers must be in [1, 8]")
    if args.baseline is not None and not (args.baseline / "gateway" / "__main__.py").exists():
        parser.error(f"--baseline {args.baseline}: not a checkout of this project")
    with replica_and_gateway(args.sim_args, peers, args.workers,
                             args.baseline) as (ports, pids, tmp):
        started = time.time()
        if args.translation:
            results = asyncio.run(measure_translation(ports["gateway"], pids, args.duration,
                                                      args.rounds))
        else:
            results = asyncio.run(measure(ports, pids, args.duration, args.rounds,
                                          PACED_SCENARIOS if args.paced else SCENARIOS))
        prof = None
        if args.profile_dir:
            prof = asyncio.run(profile(ports, pids, args.profile_dir,
                                       min(args.profile_seconds, 30.0), args.paced,
                                       args.profile_scenarios))

    report = {"command": " ".join([sys.executable, "-m", "benchmarks.overhead",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "machine": machine_info(),
              "setup": {"gateway_core": GATEWAY_CORE, "replica_core": REPLICA_CORE,
                        "client_core": CLIENT_CORE, "replica": f"sim vllm {args.sim_args}",
                        "gateway_workers": args.workers, "peers": list(peers),
                        "baseline": str(args.baseline) if args.baseline else None,
                        "warmup_s": WARMUP,
                        "seconds_per_target": args.duration, "rounds": args.rounds,
                        "targets": {"requests_per_s_per_core": TARGET_RPS,
                                    "tokens_per_s_per_core": TARGET_TOKENS_PER_S,
                                    "added_ttft_p50_ms_c1": TARGET_ADDED_TTFT_P50_MS}},
              "results": results}
    if prof is not None:
        report["profile"] = prof
    Path(args.out).write_text(json.dumps(report, indent=2))
    m = report["machine"]
    print(f"\n{m['nproc']} cores, {m['cpu_model']}, Python {m['python']}\n")
    print(translation_table(results) if args.translation else table(results))
    if prof is not None:
        print(profile_text(prof))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
