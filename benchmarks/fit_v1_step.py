"""Fit the step-time shape of the ``vllm-v1`` timing model to a real vLLM engine.

    python -m benchmarks.fit_v1_step --start [--rounds 3] [--out fit.json]
    python -m benchmarks.fit_v1_step --url http://127.0.0.1:8000 --model tiny ...

The model (``gateway/sim/vllm_v1.py``) prices one engine step as

    step = base + per_token * tokens scheduled + per_seq * requests scheduled
           (+ per_prefill * requests whose prompt is in the step, if the data ask for it)

vLLM exports no per-step time, so each load below is built to make its steps known and is
read from the engine's own Prometheus counters and histograms, before and after the load:

- **prefill P** (one request at a time, ``max_tokens`` 1, a fresh random prompt of P
  tokens, so no prefix hit): every request is one step of P tokens and one request, and
  ``vllm:request_prefill_time_seconds`` (scheduled to first token, timed in the engine core)
  is that step's time.
- **decode C** (C clients in a closed loop, prompts of 16 tokens, 128 tokens out,
  ``ignore_eos``): the engine never idles, so the mean step time is the wall time over the
  steps (``vllm:iteration_tokens_total``'s count). What the mean step holds: tokens, its sum
  over its count; requests, ``vllm:generation_tokens_total`` over the steps (every scheduled
  request samples one token when no prompt is cut into chunks, and none is: budget 2,048);
  prompts, the requests that got a first token (``vllm:request_prefill_time_seconds``'s
  count) over the steps. ``vllm:request_decode_time_seconds`` over the tokens after the
  first (the steps a request decodes in) is reported beside it as a check.
- **long C** (the same with 768-token prompts): as decode C with 50x the KV per request,
  to see whether the context a step attends over adds a term.
- **mixed C** (closed loop, 512-token prompts, 32 out): held out of the fit and predicted,
  measured as decode C.

Loads run round by round, every load once per round, so a slow spell of a shared machine
touches all of them. Other processes on the machine only ever add time to a step, so each
point's step time is its least over the rounds (``--estimator min``, the default; ``median``
is the alternative), and its composition (tokens, requests, prompts per step) the median.
The fit is least squares on the relative error (each point weighted by 1 / its step time)
over the prefill, decode and long points; the report gives each point's residual, the
held-out points' prediction errors, and the load average of each round.

``--start`` launches vLLM from ``--vllm-python`` with the tiny random-weight Llama
(``--model-dir``) on a free port and stops it by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import free_port

VLLM_PYTHON = "/work/cache-exp/vllm/bin/python"
MODEL_DIR = "/work/cache-exp/tiny"
VOCAB = 641  # the tiny model's; prompt ids are drawn from 2..VOCAB-1 (0 BOS, 1 EOS)

HISTOGRAMS = ("vllm:iteration_tokens_total", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")
COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
            "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total")


@dataclass(frozen=True)
class Load:
    name: str
    kind: str        # prefill | decode | long | mixed
    clients: int
    prompt: int
    output: int
    requests: int


LOADS = (
    *(Load(f"prefill {p}", "prefill", 1, p, 1, 24) for p in (16, 64, 128, 256, 512, 768, 1000)),
    *(Load(f"decode {c}", "decode", c, 16, 128, max(4, 2 * c)) for c in (1, 2, 4, 8, 16, 32, 64)),
    *(Load(f"long {c}", "long", c, 768, 128, max(4, 2 * c)) for c in (4, 16)),
    *(Load(f"mixed {c}", "mixed", c, 512, 32, 6 * c) for c in (4, 16)),
)
FITTED = ("prefill", "decode", "long")


# ---------------------------------------------------------------------------------------------
# The engine's metrics

def scrape(url: str) -> dict[str, float]:
    """Sums over label sets of the histograms' _sum/_count and of the counters."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = {f"{h}{s}" for h in HISTOGRAMS for s in ("_sum", "_count")} | set(COUNTERS)
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


# ---------------------------------------------------------------------------------------------
# Load

async def closed_loop(url: str, model: str, load: Load, rng: random.Random) -> float:
    """``load.requests`` requests from ``load.clients`` clients; returns the wall seconds."""
    queue = list(range(load.requests))

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            queue.pop()
            body = {"model": model, "prompt": [rng.randrange(2, VOCAB) for _ in range(load.prompt)],
                    "max_tokens": load.output, "ignore_eos": True, "temperature": 0.0}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{load.name}: {resp.status} {data}")

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(load.clients)))
        return time.monotonic() - started


def measure(url: str, model: str, load: Load, rng: random.Random) -> dict[str, Any]:
    before = scrape(url)
    wall = asyncio.run(closed_loop(url, model, load, rng))
    d = delta(scrape(url), before)
    steps = d["vllm:iteration_tokens_total_count"]
    generated = d["vllm:generation_tokens_total"]
    requests = d["vllm:request_prefill_time_seconds_count"]
    point: dict[str, Any] = {
        "load": load.name, "kind": load.kind, "wall_s": wall, "steps": steps,
        "tokens_per_step": d["vllm:iteration_tokens_total_sum"] / steps,
        "seqs_per_step": generated / steps,
        "prefills_per_step": requests / steps,
        "wall_step_s": wall / steps,
        "decode_step_s": (d["vllm:request_decode_time_seconds_sum"] / (generated - requests)
                          if generated > requests else None),
        "prefix_hit_tokens": d["vllm:prefix_cache_hits_total"],
        "preemptions": d["vllm:num_preemptions_total"],
        # the mean context (KV tokens) a scheduled request attends over, for the "long" check
        "context_per_seq": load.prompt + (load.output / 2 if load.output > 1 else 0),
    }
    if load.kind == "prefill":
        point["step_s"] = d["vllm:request_prefill_time_seconds_sum"] / requests
        point["seqs_per_step"] = point["prefills_per_step"] = 1.0
        point["tokens_per_step"] = float(load.prompt)
    else:
        point["step_s"] = point["wall_step_s"]
    return point


# ---------------------------------------------------------------------------------------------
# Fit

def least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Ordinary least squares by the normal equations (a handful of unknowns)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(k):
            if r != col and a[col][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(k)]


SHAPES = {  # name -> the terms of a point, in the order of the coefficients
    "base + tokens": lambda p: [1.0, p["tokens_per_step"]],
    "base + tokens + seqs": lambda p: [1.0, p["tokens_per_step"], p["seqs_per_step"]],
    "base + tokens + seqs + prefills": lambda p: [
        1.0, p["tokens_per_step"], p["seqs_per_step"], p["prefills_per_step"]],
    "base + tokens + seqs + prefills + context": lambda p: [
        1.0, p["tokens_per_step"], p["seqs_per_step"], p["prefills_per_step"],
        p["seqs_per_step"] * p["context_per_seq"]],
}


def fit(points: list[dict[str, Any]]) -> dict[str, Any]:
    train = [p for p in points if p["kind"] in FITTED]
    out = {}
    for shape, terms in SHAPES.items():
        coef = least_squares([[t / p["step_s"] for t in terms(p)] for p in train],
                             [1.0] * len(train))
        residuals = {p["load"]: (sum(c * t for c, t in zip(coef, terms(p))) - p["step_s"])
                     / p["step_s"] for p in points}
        fitted = [residuals[p["load"]] for p in train]
        held = [residuals[p["load"]] for p in points if p["kind"] not in FITTED]
        out[shape] = {"coefficients": coef,
                      "rms_relative_residual": statistics.fmean(r * r for r in fitted) ** 0.5,
                      "max_relative_residual": max(map(abs, fitted)),
                      "held_out_relative_errors": held,
                      "relative_residuals": residuals}
    return out


# ---------------------------------------------------------------------------------------------
# The engine

def start_vllm(python: str, model_dir: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix="vc-fit-")}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "tiny", "--max-model-len", "1024", "--enforce-eager",
           "--dtype", "float32", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(1)
    stop(proc)
    raise TimeoutError(f"vLLM not healthy after 300 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the engine's process group (it has an engine-core child), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------------------------------

def report(result: dict[str, Any]) -> str:
    hits = sum(p["prefix_hit_tokens"] for p in result["points"])
    preemptions = sum(p["preemptions"] for p in result["points"])
    lines = [f"vLLM CPU engine, {result['rounds']} rounds (step: the {result['estimator']} over "
             "them), load average per round: "
             + ", ".join(f"{a:.2f}-{b:.2f}" for a, b in result["load_average"])
             + f"; prefix-cache hit tokens {hits:.0f}, preemptions {preemptions:.0f} (both "
             "should be 0)", "",
             "| load | tokens/step | requests/step | prompts/step | step ms (per round)"
             " | decode steps ms |", "|---|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        decode = "" if p["decode_step_s"] is None else f"{p['decode_step_s'] * 1e3:.2f}"
        lines.append(f"| {p['load']} | {p['tokens_per_step']:.1f} | {p['seqs_per_step']:.2f} | "
                     f"{p['prefills_per_step']:.3f} | {p['step_s'] * 1e3:.2f} "
                     f"({' / '.join(f'{v * 1e3:.2f}' for v in p['step_s_by_round'])}) | {decode} |")
    for shape, f in result["fit"].items():
        coef = ", ".join(f"{c * 1e3:.4f}" for c in f["coefficients"])
        lines += ["", f"**{shape}** (ms): {coef}; RMS relative residual "
                  f"{f['rms_relative_residual']:.1%}, max {f['max_relative_residual']:.1%}; "
                  "held out: " + ", ".join(f"{e:+.1%}" for e in f["held_out_relative_errors"]),
                  "", "| load | residual |", "|---|---:|"]
        lines += [f"| {k} | {v:+.1%} |" for k, v in f["relative_residuals"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fit_v1_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running vLLM engine (else --start)")
    parser.add_argument("--model", default="tiny", help="its served model name")
    parser.add_argument("--start", action="store_true", help="start vLLM, stop it at the end")
    parser.add_argument("--vllm-python", default=VLLM_PYTHON)
    parser.add_argument("--model-dir", default=MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--estimator", choices=("min", "median"), default="min",
                        help="a point's step time over the rounds (default min: contention "
                             "only adds time)")
    parser.add_argument("--loads", nargs="+", help="only these loads (names as in the table)")
    parser.add_argument("--out", type=Path, default=Path("fit_v1_step.json"))
    args = parser.parse_args(argv)
    if not args.url and not args.start:
        parser.error("give --url or --start")
    loads = [lo for lo in LOADS if not args.loads or lo.name in args.loads]
    proc = None
    if args.start:
        proc, args.url = start_vllm(args.vllm_python, args.model_dir,
                                    Path(tempfile.mkdtemp(prefix="fit-v1-")) / "vllm.log")
    try:
        rng = random.Random()  # fresh prompts every run: an engine's prefix cache outlives a run
        measure(args.url, args.model, Load("warm-up", "mixed", 4, 256, 16, 16), rng)
        by_load: dict[str, list[dict[str, Any]]] = {lo.name: [] for lo in loads}
        load_average = []
        for r in range(args.rounds):
            first = os.getloadavg()[0]
            for lo in loads:
                by_load[lo.name].append(measure(args.url, args.model, lo, rng))
                p = by_load[lo.name][-1]
                print(f"round {r + 1} {lo.name}: step {p['step_s'] * 1e3:.2f} ms, "
                      f"{p['tokens_per_step']:.1f} tokens, {p['seqs_per_step']:.2f} requests",
                      file=sys.stderr, flush=True)
            load_average.append((first, os.getloadavg()[0]))
    finally:
        if proc is not None:
            stop(proc)
    points = []
    for name, runs in by_load.items():
        point = dict(runs[0])
        for key in ("wall_step_s", "tokens_per_step", "seqs_per_step", "prefills_per_step"):
            point[key] = statistics.median(run[key] for run in runs)
        point["step_s"] = (min if args.estimator == "min" else statistics.median)(
            run["step_s"] for run in runs)
        decode = [run["decode_step_s"] for run in runs if run["decode_step_s"] is not None]
        point["decode_step_s"] = statistics.median(decode) if decode else None
        point["step_s_by_round"] = [run["step_s"] for run in runs]
        point["prefix_hit_tokens"] = sum(run["prefix_hit_tokens"] for run in runs)
        point["preemptions"] = sum(run["preemptions"] for run in runs)
        points.append(point)
    result = {"rounds": args.rounds, "estimator": args.estimator,
              "load_average": load_average, "points": points,
              "fit": fit(points), "command": " ".join(sys.argv)}
    args.out.write_text(json.dumps(result, indent=2))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
