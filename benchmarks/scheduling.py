"""Scheduling benchmark: every balancing policy, and two peer routers, on three workloads.

    python -m benchmarks.scheduling [--requests N] [--workloads W1 W2 W3] [--rows ...]
        [--seeds 1 2] [--profile P] [--router-venv DIR] [--out F.json] [--markdown F.md]

Four simulated vLLM replicas (continuous batching, prefix cache on) of one timing model
(``--profile``: the calibrated ``llama3-8b-a100``, or ``llama3-8b-h100-kvpoor``, faster
steps and a sixth of the KV cache, so that weights tuned on one are checked on another) on
loopback; in front of them, one row at a time, our gateway with each policy, then
sglang-router (cache_aware) and vllm-router (cache_aware, power_of_two) when they are
installed in ``--router-venv`` (``pip install sglang-router vllm-router`` there: they are not
dependencies of the product). Every row of a workload gets
the same seeded open-loop schedule and fresh replicas (empty caches). Workloads:

- **W1 mixed lengths**: 85% short prompts (100-400 tokens, 50-200 out), 15% long ones
  (3k-6k tokens, 100-300 out), Poisson at 80% of round robin's saturation.
- **W2 shared prefixes**: 16 system prompts of 2,000 tokens, popularity Zipf(1) (the most
  popular takes ~30% of traffic), each followed by a 50-300-token user part, 50-200 out;
  the replicas' KV cache (and so prefix cache) holds 24,000 tokens, less than the 32,000
  all prefixes need; 80% of round robin's saturation.
- **W3 both, with bursts**: half W1 requests, half W2, on W2's replicas; the arrival rate
  alternates every 10 simulated seconds between 50% and 110% of round robin's saturation.
- **W4 tenants** (llm-d's published shape, 150 tenants with 6k-token prefixes on 8 pods,
  scaled to 4 replicas): 75 tenants, uniform, each request its tenant's 6,000-token prefix +
  a 50-150-token question, 30-100 out; each replica's KV capped at 300,000 tokens, so the
  450,000 prefix tokens fit the fleet's caches (37.5%) but not one's (1.5x); the rate ramps
  linearly from 20% to 150% of round robin's saturation.

Saturation rates (requests/s, 4 replicas) come from running round robin on the same timing
model in virtual time (``gateway.sim.scheduler.BatchScheduler``) at overload
(``TIMING_MODELS``): on the A100 profile W1 47, W2 23.5, W3 22.4, W4 24.8; on the H100 one
78, 40, 41, 27.6; on vLLM V1's 63, 45.7, 33.9, 33.5. ``--speed`` compresses or stretches time per workload (the simulated GPU runs ``speed``
times real time; on another profile scaled so the wall-clock request rate stays the same);
TTFTs are reported in simulated seconds (wall x speed), which is what the same GPUs would
show. The default speeds keep the streamed tokens/s low enough that
two CPU cores, not the policy, are never the limit.

A TTFT p99 is set by a workload's worst ~1% of requests, so one schedule can favour one
router by luck (a burst that happens to suit it); ``--seeds`` runs each row on several seeded
schedules and reports each seed's figure and their mean.

A row ``policy@events`` (``--profile llama3-8b-h100-vllm-v1`` only) starts replicas that
publish their KV-cache events (``--kv-events-port``: HTTP port + 1000, replay + 2000, the
gateway's default rule) and a gateway with ``kv_events: {enabled: true}`` and the sims'
tokenizer: precise prefix-cache routing; its figures add the gateway's ``llm_gateway_kv_*``.

Output: a markdown table per workload (TTFT p50/p99, output tokens/s, requests per replica,
prefix-cache hit rate: means over the seeds, p99 also per seed) and every figure as JSON,
plus the issue's targets checked on the means. ``benchmarks.scheduling_virtual`` runs the
same schedules through our policies in virtual time (no HTTP, deterministic, seconds per
row), for tuning weights.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from gateway.bench.loadgen import Request, Target, open_loop
from benchmarks.harness import HOST, ROOT, free_port, stop, wait_ready
from benchmarks.stats import p99_difference
from gateway.bench.report import distribution_ms, summarize
from gateway.bench.workload import synthetic_prompt

MODEL = "m"
REPLICAS = 4
MAX_MODEL_LEN = 16384
REQUEST_TIMEOUT = 300.0

OUR_POLICIES = ("round_robin", "least_requests", "least_outstanding_tokens", "least_expected_work")
PEER_ROUTERS = {  # row -> (console script in the router venv, its policy)
    "sglang-router cache_aware": ("sglang-router", "cache_aware"),
    "vllm-router cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router power_of_two": ("vllm-router", "power_of_two"),
}
DEFAULT = "least_expected_work"
ABLATIONS = (f"{DEFAULT}:prefix_weight=0", f"{DEFAULT}:signals_weight=0")


# Round robin's saturation, requests/s in simulated time per workload, on each timing model
# (every request of the workload's mix arriving at once, in virtual time:
# `python -m benchmarks.scheduling_virtual --saturation`).
TIMING_MODELS = {
    "llama3-8b-a100": {"W1": 47.0, "W2": 23.5, "W3": 22.4, "W4": 24.8},
    "llama3-8b-h100-kvpoor": {"W1": 78.4, "W2": 40.0, "W3": 41.0, "W4": 27.6},
    # held out: vLLM V1's own scheduler (gateway/sim/vllm_v1.py), step time fitted
    "llama3-8b-h100-vllm-v1": {"W1": 63.0, "W2": 45.7, "W3": 33.9, "W4": 33.5},
}
DEFAULT_PROFILE = "llama3-8b-a100"


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    saturation: float            # round robin's, requests/s in simulated time
    load: float                  # share of saturation (W3: the mean of its two phases)
    kv_capacity_tokens: int | None  # a cap on the replicas' KV cache (W2, W3)
    speed: float
    profile: str = DEFAULT_PROFILE  # the replicas' timing model

    def on(self, profile: str) -> "Workload":
        """The same workload on another timing model: its saturation there, and the wall-clock
        speed scaled so that requests/s on the wall clock (the CPU's load) stay the same."""
        saturation = TIMING_MODELS[profile][self.name]
        return replace(self, profile=profile, saturation=saturation,
                       speed=self.speed * TIMING_MODELS[DEFAULT_PROFILE][self.name] / saturation)


WORKLOADS = {
    "W1": Workload("W1", "mixed lengths", 47.0, 0.8, None, 0.5),
    "W2": Workload("W2", "shared prefixes", 23.5, 0.8, 24000, 1.0),
    "W3": Workload("W3", "both, bursts 50%/110%", 22.4, 0.8, 24000, 1.0),
    # llm-d's shape: many tenants, each a long prefix; the load ramps past saturation
    "W4": Workload("W4", "tenants, ramp 20%->150%", 24.8, 0.85, 300000, 0.5),
}
BURST_PERIOD = 10.0  # simulated seconds per phase
PREFIXES, PREFIX_TOKENS = 16, 2000
# W4: llm-d published 150 tenants with 6,000-token prefixes on 8 vLLM pods; on 4 replicas,
# 75 tenants. Their 450,000 prefix tokens fit the fleet's KV (4 x 300,000: 37.5%) but not
# one replica's (1.5x its cache), so only a router that keeps each tenant on few replicas
# can serve them from cache.
TENANTS, TENANT_PREFIX_TOKENS = 75, 6000
RAMP = (0.2, 1.5)  # W4's arrival rate, as shares of saturation, from first request to last


# ---------------------------------------------------------------------------------------------
# Schedules: seeded requests and arrival times (simulated seconds)

def _mixed(rng: random.Random) -> Request:
    if rng.random() < 0.15:
        prompt, out, tag = rng.randint(3000, 6000), rng.randint(100, 300), "long"
    else:
        prompt, out, tag = rng.randint(100, 400), rng.randint(50, 200), "short"
    return Request(prompt=synthetic_prompt(prompt, rng), max_tokens=out, tag=tag)


def _shared(rng: random.Random, prefixes: list[str]) -> Request:
    k = rng.choices(range(len(prefixes)), [1 / (i + 1) for i in range(len(prefixes))])[0]
    suffix = synthetic_prompt(rng.randint(50, 300), rng)
    return Request(prompt=prefixes[k] + suffix, max_tokens=rng.randint(50, 200),
                   tag=f"prefix{k}")


def _tenant(rng: random.Random, prefixes: list[str]) -> Request:
    """W4: a tenant (uniform) and its prefix, then a short question of its own, short out."""
    k = rng.randrange(len(prefixes))
    question = synthetic_prompt(rng.randint(50, 150), rng)
    return Request(prompt=prefixes[k] + question, max_tokens=rng.randint(30, 100),
                   tag=f"tenant{k}")


def _tenants(w: Workload, n: int, seed: int) -> tuple[list[Request], list[float]]:
    rng = random.Random(seed)
    prefixes = [synthetic_prompt(TENANT_PREFIX_TOKENS, random.Random(f"tenant-{seed}-{k}"))
                for k in range(TENANTS)]
    requests, arrivals, t = [], [], 0.0
    low, high = RAMP
    for i in range(n):  # the rate ramps linearly with the request's place in the schedule
        t += rng.expovariate(w.saturation * (low + (high - low) * i / max(1, n - 1)))
        arrivals.append(t)
        requests.append(_tenant(rng, prefixes))
    return requests, arrivals


def schedule(w: Workload, n: int, seed: int) -> tuple[list[Request], list[float]]:
    """The same requests and arrivals for every row of a workload."""
    if w.name == "W4":
        return _tenants(w, n, seed)
    rng = random.Random(seed)
    prefixes = [synthetic_prompt(PREFIX_TOKENS, random.Random(f"prefix-{seed}-{k}"))
                for k in range(PREFIXES)]
    requests, arrivals, t = [], [], 0.0
    mean_rate = w.saturation * w.load
    for _ in range(n):
        rate = mean_rate
        if w.name == "W3":  # 50% and 110% of saturation, alternating
            rate = w.saturation * (0.5 if int(t // BURST_PERIOD) % 2 == 0 else 1.1)
        t += rng.expovariate(rate)
        arrivals.append(t)
        if w.name == "W1" or (w.name == "W3" and rng.random() < 0.5):
            requests.append(_mixed(rng))
        else:
            requests.append(_shared(rng, prefixes))
    return requests, arrivals


# ---------------------------------------------------------------------------------------------
# Processes

def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


# An `@events` row: the replicas publish KV-cache events on their HTTP port + these (the
# gateway's default rule, `kv_events.port_offset` and `replay_port_offset`) and the gateway
# subscribes (`kv_events: {enabled: true}`): precise prefix-cache routing.
EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET = 1000, 2000


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _events_port() -> int:
    """A free HTTP port whose event and replay ports (+1000, +2000) are free too."""
    while True:
        port = free_port()
        if port + REPLAY_PORT_OFFSET <= 65535 and all(
                _port_free(port + k) for k in (EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET)):
            return port


def _sim_publishes_events() -> bool:
    """The simulator here has ``--kv-events-port`` (it publishes vLLM's KV events)."""
    out = subprocess.run([sys.executable, "-m", "gateway", "sim", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    return "--kv-events-port" in out


def events_row(row: str) -> tuple[str, bool]:
    """``policy[:weights][@events]`` -> the row without the flag, and whether it is set."""
    base, _, flag = row.partition("@")
    if flag not in ("", "events"):
        raise ValueError(f"row {row!r}: the wall-clock rows take only @events")
    return base, flag == "events"


@contextlib.contextmanager
def replicas(w: Workload, tmp: Path, events: bool = False) -> Iterator[list[str]]:
    """Four fresh simulated replicas (empty caches); yields their URLs. ``events``: each
    publishes its KV-cache events on its HTTP port + 1000 (replay + 2000)."""
    procs, urls = [], []
    try:
        for i in range(REPLICAS):
            port = _events_port() if events else free_port()
            args = ["sim", "--dialect", "vllm", "--profile", w.profile, "--port", str(port),
                    "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--speed",
                    str(w.speed), "--prefix-cache"]
            if events:
                args += ["--kv-events-port", str(port + EVENTS_PORT_OFFSET),
                         "--kv-replay-port", str(port + REPLAY_PORT_OFFSET)]
            if w.kv_capacity_tokens:
                args += ["--kv-capacity-tokens", str(w.kv_capacity_tokens)]
            procs.append(_spawn([sys.executable, "-m", "gateway", *args], tmp / f"sim{i}.log"))
            urls.append(f"http://{HOST}:{port}")
        for url, proc in zip(urls, procs):
            wait_ready(f"{url}/health", proc)
        yield urls
    finally:
        for proc in procs:
            stop(proc)


def _row_settings(row: str) -> tuple[str, dict[str, float]]:
    """``least_expected_work:prefix_weight=0,signals_weight=0`` -> policy and overrides."""
    policy, _, spec = row.partition(":")
    overrides = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        overrides[key.strip()] = float(value)
    return policy, overrides


@contextlib.contextmanager
def router(row: str, urls: list[str], tmp: Path, venv: Path) -> Iterator[str]:
    """The row's router in front of ``urls``; yields its base URL."""
    port = free_port()
    if row in PEER_ROUTERS:
        script, policy = PEER_ROUTERS[row]
        cmd = [str(venv / "bin" / script)]
        if script == "sglang-router":
            cmd.append("launch")
        cmd += ["--host", HOST, "--port", str(port), "--policy", policy, "--worker-urls", *urls,
                # their metrics exporter defaults to a fixed port (29000) on every interface:
                # a leftover router there fails the row
                "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        ready = f"http://{HOST}:{port}/v1/models"
    else:
        base, events = events_row(row)
        policy, overrides = _row_settings(base)
        config = tmp / "gateway.yaml"
        model: dict[str, Any] = {"name": MODEL, "max_model_len": MAX_MODEL_LEN,
                                 "replicas": [{"url": u, "engine": "vllm"} for u in urls]}
        if events:  # keys need the token ids: the sims' own tokenizer (their default)
            from gateway.sim.model_dir import builtin_model_dir
            model["tokenizer"] = str(builtin_model_dir())
        config.write_text(json.dumps({  # JSON is YAML
            "models": [model], "balancer": policy, "scheduling": overrides,
            **({"kv_events": {"enabled": True}} if events else {}),
        }))
        cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(config),
               "--port", str(port), "--log-level", "warning"]
        ready = f"http://{HOST}:{port}/ready"
    proc = _spawn(cmd, tmp / f"router-{port}.log")
    try:
        wait_ready(ready, proc, timeout=60)
        yield f"http://{HOST}:{port}"
    finally:
        stop(proc)


def unavailable(row: str, venv: Path, profile: str = DEFAULT_PROFILE) -> str | None:
    """Why a peer router's row, or an `@events` row, cannot run here (None: it can)."""
    if row not in PEER_ROUTERS:
        if events_row(row)[1]:
            from gateway.sim.profiles import PROFILES
            if PROFILES[profile].kind != "vllm-v1":
                return (f"KV events come from the vLLM V1 timing model only: --profile "
                        f"llama3-8b-h100-vllm-v1 (not {profile})")
            if not _sim_publishes_events():
                return ("the simulator here has no --kv-events-port (it does not publish "
                        "KV events)")
        return None
    script = venv / "bin" / PEER_ROUTERS[row][0]
    if not script.exists():
        return (f"{script} not found: install it with `python -m venv {venv} && "
                f"{venv}/bin/pip install sglang-router vllm-router`")
    return None


# ---------------------------------------------------------------------------------------------
# One row

def run_row(w: Workload, row: str, requests: list[Request], arrivals: list[float],
            venv: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"gw-sched-{w.name}-"))
    with replicas(w, tmp, events_row(row)[1] if row not in PEER_ROUTERS else False) as urls, \
            router(row, urls, tmp, venv) as url:
        target = Target(url, api="openai", endpoint="/v1/completions", stream=True, model=MODEL)
        wall_arrivals = [a / w.speed for a in arrivals]
        started = time.monotonic()
        run = asyncio.run(open_loop(target, requests, wall_arrivals, timeout=REQUEST_TIMEOUT))
        elapsed = time.monotonic() - started
        states = [_get_json(f"{u}/sim/state") for u in urls]
        kv = _kv_metrics(url) if events_row(row)[1] and row not in PEER_ROUTERS else None
    overall = summarize(run)["overall"]
    ttft = overall.get("ttft_ms") or {}
    per_replica = [s["completed_total"] + s["aborted_total"] for s in states]
    prompt = sum(s["prompt_tokens_total"] for s in states)
    hits = sum(s["prefix_cache_hit_tokens"] for s in states)
    return {
        "row": row, "requests": overall["requests"], "ok": overall["ok"],
        "errors": overall["errors"],
        # simulated seconds: what the same GPUs would show at speed 1
        "ttft_p50_s": _sim_s(ttft.get("p50"), w.speed),
        "ttft_p99_s": _sim_s(ttft.get("p99"), w.speed),
        "ttft_p99_long_s": _sim_s(_p99_ms([r for r in run.records if r.tag == "long"]), w.speed),
        "output_tokens_per_s": round(overall["output_tokens_per_s"] / w.speed, 1)
        if overall["output_tokens_per_s"] else None,
        "requests_per_replica": per_replica,
        "prefix_cache_hit_rate": round(hits / prompt, 3) if prompt else None,
        "wall_s": round(elapsed, 1), "logs": str(tmp),
        **({"kv_events": kv} if kv is not None else {}),
        # in schedule order, for comparing rows request by request (None: not served)
        "ttft_by_request_s": [r.ttft * w.speed if r.ok and r.ttft is not None else None
                              for r in run.records],
    }


def _kv_metrics(url: str) -> dict[str, float]:
    """The gateway's KV-event figures summed over replicas (``llm_gateway_kv_*``): that the
    events were read and routed on (events, live replicas, predicted / prompt tokens)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llm_gateway_kv_"):
            name, _, value = line.rpartition(" ")
            key = name.partition("{")[0]
            if key.endswith("_created"):
                continue
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _sim_s(ms: float | None, speed: float) -> float | None:
    return None if ms is None else round(ms / 1e3 * speed, 3)


def _p99_ms(records: list) -> float | None:
    values = [r.ttft for r in records if r.ok and r.ttft is not None]
    return distribution_ms(values)["p99"] if values else None


def combine_seeds(row: str, by_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One row over several schedules: means of the figures, p99 kept per seed too."""
    failed = [r["unavailable"] for r in by_seed.values() if "unavailable" in r]
    if failed:
        return {"row": row, "unavailable": failed[0], "by_seed": by_seed}
    runs = list(by_seed.values())

    def mean(key: str) -> float | None:
        values = [r[key] for r in runs]
        return None if None in values else round(statistics.mean(values), 3)

    errors: dict[str, int] = {}
    for r in runs:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    return {
        "row": row, "requests": sum(r["requests"] for r in runs),
        "ok": sum(r["ok"] for r in runs), "errors": errors,
        "ttft_p50_s": mean("ttft_p50_s"), "ttft_p99_s": mean("ttft_p99_s"),
        "ttft_p99_s_by_seed": {seed: r["ttft_p99_s"] for seed, r in by_seed.items()},
        "ttft_p99_long_s": mean("ttft_p99_long_s"),
        "output_tokens_per_s": mean("output_tokens_per_s"),
        "requests_per_replica": [sum(n) for n in zip(*(r["requests_per_replica"] for r in runs))],
        "prefix_cache_hit_rate": mean("prefix_cache_hit_rate"),
        "by_seed": by_seed,
    }


def compare_to_default(rows: list[dict[str, Any]]) -> None:
    """Give every other row its mean p99 minus the default's with a 95% interval
    (``benchmarks.stats.p99_difference``): which differences chance could explain."""
    served = [r for r in rows if r.get("ttft_p99_s") is not None]  # ran, and served some
    ours = next((r for r in served if r["row"] == DEFAULT), None)
    if ours is None:
        return
    for r in served:
        if r is not ours:
            r["p99_minus_default_s"] = [round(v, 3) for v in p99_difference(
                [s["ttft_by_request_s"] for s in r["by_seed"].values()],
                [s["ttft_by_request_s"] for s in ours["by_seed"].values()])]


# ---------------------------------------------------------------------------------------------
# Report

def check_targets(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets for one workload, each line starting with PASS or FAIL."""
    ran = {r["row"]: r for r in rows  # ablation rows (`policy:weights`) are not contenders
           if r.get("ttft_p99_s") is not None and ":" not in r["row"]}
    ours = ran.get(DEFAULT)
    if ours is None:
        return [f"FAIL {name}: no {DEFAULT} row"]
    out = []
    best = min(ran.values(), key=lambda r: r["ttft_p99_s"])
    out.append(f"{'PASS' if best['row'] == DEFAULT else 'FAIL'} {name}: lowest TTFT p99 "
               f"({ours['ttft_p99_s']} s; best other "
               f"{min((r['ttft_p99_s'] for r in ran.values() if r is not ours), default=None)} s)")
    rr = ran.get("round_robin")
    if rr and rr["output_tokens_per_s"] and ours["output_tokens_per_s"]:
        ok = ours["output_tokens_per_s"] >= 0.98 * rr["output_tokens_per_s"]  # same offered load
        out.append(f"{'PASS' if ok else 'FAIL'} {name}: throughput {ours['output_tokens_per_s']} "
                   f">= round robin's {rr['output_tokens_per_s']} (within 2% run noise)")
    lot = ran.get("least_outstanding_tokens")
    if name == "W1" and lot:
        ok = ours["ttft_p99_s"] <= 1.1 * lot["ttft_p99_s"]
        out.append(f"{'PASS' if ok else 'FAIL'} W1: within 10% of least_outstanding_tokens "
                   f"({ours['ttft_p99_s']} vs {lot['ttft_p99_s']} s)")
    if name == "W2":
        fair = sum(ours["requests_per_replica"]) / len(ours["requests_per_replica"])
        ok = min(ours["requests_per_replica"]) >= fair / 2
        out.append(f"{'PASS' if ok else 'FAIL'} W2: every replica >= half its fair share "
                   f"({ours['requests_per_replica']})")
        peers = [r for r in ran.values() if "cache_aware" in r["row"]]
        if peers:
            best_peer = min(peers, key=lambda r: r["ttft_p99_s"])
            ok = ours["ttft_p99_s"] <= best_peer["ttft_p99_s"]
            out.append(f"{'PASS' if ok else 'FAIL'} W2: at least as good as the best "
                       f"prefix-aware router ({best_peer['row']}: {best_peer['ttft_p99_s']} s)")
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results["workloads"].items():
        w = WORKLOADS[name].on(results["profile"])
        seeds = res.get("seeds", [1])
        lines += [f"**{name} {w.title}** on {w.profile} ({res['requests']} requests per "
                  f"seed, seeds {', '.join(map(str, seeds))}; {res['mean_rate']:.1f} req/s mean, speed "
                  f"{w.speed:g})", "",
                  "| row | TTFT p50 s | TTFT p99 s (per seed) | p99 minus the default's (95% "
                  "interval) | output tok/s | requests per replica | prefix hit |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        for r in res["rows"]:
            if "unavailable" in r:
                lines.append(f"| {r['row']} | unavailable: {r['unavailable']} | | | | | |")
                continue
            errors = f" ({sum(r['errors'].values())} errors)" if r["errors"] else ""
            hit = r["prefix_cache_hit_rate"]
            per_replica = "/".join(map(str, r["requests_per_replica"]))
            per_seed = r.get("ttft_p99_s_by_seed", {})
            p99 = str(r['ttft_p99_s'])
            if len(per_seed) > 1:
                p99 += f" ({' / '.join(str(v) for v in per_seed.values())})"
            diff = r.get("p99_minus_default_s")
            versus = "" if diff is None else f"{diff[0]:+.3f} ({diff[1]:+.3f} .. {diff[2]:+.3f})"
            lines.append(f"| {r['row']}{errors} | {r['ttft_p50_s']} | {p99} | {versus} | "
                         f"{r['output_tokens_per_s']} | {per_replica}"
                         f" | {'' if hit is None else f'{hit:.0%}'} |")
        lines += [""] + [f"- {t}" for t in res["targets"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                        choices=list(WORKLOADS))
    parser.add_argument("--rows", nargs="+", default=[*OUR_POLICIES, *PEER_ROUTERS, *ABLATIONS],
                        help="policies of ours (optionally `policy:key=value,...` with "
                             "scheduling weights, for ablations) and peer router rows")
    parser.add_argument("--requests", type=int, default=800, help="per workload and row")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1],
                        help="seeded schedules per workload (each row runs all of them)")
    parser.add_argument("--router-venv", type=Path, default=Path(os.environ.get(
        "BENCH_VENV", "/work/bench-venv")), help="venv holding sglang-router and vllm-router")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=list(TIMING_MODELS),
                        help="the replicas' timing model (gateway.sim.profiles)")
    parser.add_argument("--out", type=Path, default=Path("scheduling.json"))
    parser.add_argument("--markdown", type=Path, default=Path("scheduling.md"))
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the replicas and routers of the row in progress are
    # stopped (a router left behind keeps its ports and fails later rows).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    results: dict[str, Any] = {"workloads": {}, "profile": args.profile,
                               "command": " ".join(sys.argv)}
    for name in args.workloads:
        w = WORKLOADS[name].on(args.profile)
        schedules = {seed: schedule(w, args.requests, seed) for seed in args.seeds}
        res = {"requests": args.requests, "seeds": args.seeds, "mean_rate": statistics.mean(
            len(arr) / arr[-1] for _, arr in schedules.values()), "rows": []}
        results["workloads"][name] = res
        for row in args.rows:
            why = unavailable(row, args.router_venv, args.profile)
            if why:
                res["rows"].append({"row": row, "unavailable": why})
                continue
            by_seed = {}
            for seed, (requests, arrivals) in schedules.items():
                print(f"{name} seed {seed} {row} ...", file=sys.stderr, flush=True)
                try:
                    by_seed[seed] = run_row(w, row, requests, arrivals, args.router_venv)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    by_seed[seed] = {"row": row, "unavailable": f"failed to run: {exc}"}
                shown = {k: v for k, v in by_seed[seed].items() if k != "ttft_by_request_s"}
                print(f"  {shown}", file=sys.stderr, flush=True)
            res["rows"].append(combine_seeds(row, by_seed))
        compare_to_default(res["rows"])
        res["targets"] = check_targets(name, res["rows"])
        args.out.write_text(json.dumps(results, indent=2))
    text = markdown(results)
    args.markdown.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
