"""Priority at saturation on real vLLM (the CPU build): interactive TTFT through the gateway
with flow control on and off, and where the queue is held.

    PYTHONPATH=. python -m benchmarks.flow_control_real [--rounds 3] [--seconds 30]
        [--batch-clients 12] [--interactive-rate 2]

Two vLLM engines serve the tiny random-weight Llama the tests build (``tests/real_engines``),
each with ``--max-num-seqs 4`` so that a dozen clients saturate them. Batch clients (priority
0) loop on streamed requests of 96 tokens; interactive requests (priority 1,
``x-slo-ttft-ms: 500``) arrive as a Poisson stream of 8-token requests. The same traffic runs
through three gateways, alternately, ``--rounds`` times each: the engine-signal gate
(``max_waiting: 1``, scrapes every 0.1 s, fresh for 1 s), the ledger's gate
(``max_outstanding_tokens: 400``, about four requests per engine) and ``saturation: false``. Reported per setting:
interactive TTFT p50, p90 and max (the client's, from sending to the first token), batch
tokens/s, and the engines' own ``vllm:num_requests_waiting`` and the gateway's
``llm_gateway_waiting_requests``, sampled every 0.25 s (mean and max).

Wall-clock and on a shared machine: the rounds alternate so that a slow spell touches both
settings, and the spread over rounds is printed beside each mean.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "real_engines")]

from engines import VllmSpec, vllms  # noqa: E402  (the tests' real engine harness)
from support import gateway_server  # noqa: E402
from tiny_model import write_tiny_llama  # noqa: E402

from gateway.bench.report import percentile  # noqa: E402

SETTINGS = {  # flow_control of each gateway
    "engine-signal gate": {"max_waiting": 1},  # vLLM's own queue, scraped every 0.1 s
    "ledger gate": {"max_outstanding_tokens": 400},  # ~4 requests of 96 tokens per engine
    "off": {"saturation": False}}


def engine_waiting(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_waiting{"))


def gateway_waiting(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llm_gateway_waiting_requests{"))


def stream(url: str, priority: int, tokens: int, extra: dict[str, str]) -> tuple[float, int]:
    """One streamed completion: seconds to its first token, and tokens received."""
    started, first, count = time.monotonic(), None, 0
    body = {"model": "tiny", "prompt": "once upon a time", "max_tokens": tokens,
            "stream": True, "ignore_eos": True}
    headers = {"x-gateway-priority": str(priority), **extra}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                first = first or time.monotonic()
                count += 1
    return (first or time.monotonic()) - started, count


def run(gateway: str, engines: list[str], seconds: float, batch_clients: int, rate: float,
        seed: int) -> dict[str, Any]:
    stop = time.monotonic() + seconds
    ttfts: list[float] = []
    batch_tokens = [0]
    samples: list[tuple[float, float]] = []
    lock = threading.Lock()

    def batch() -> None:
        while time.monotonic() < stop:
            _, n = stream(gateway, 0, 96, {})
            with lock:
                batch_tokens[0] += n

    def interactive() -> None:
        ttft, _ = stream(gateway, 1, 8, {"x-slo-ttft-ms": "500"})
        with lock:
            ttfts.append(ttft)

    def sampler() -> None:
        while time.monotonic() < stop:
            with contextlib.suppress(httpx.HTTPError):  # a scrape too slow: the next one
                samples.append((sum(engine_waiting(e) for e in engines),
                                gateway_waiting(gateway)))
            time.sleep(0.25)

    threads = [threading.Thread(target=batch) for _ in range(batch_clients)]
    threads.append(threading.Thread(target=sampler))
    for t in threads:
        t.start()
    time.sleep(2.0)  # the batch clients saturate the engines first
    rng, asked = random.Random(seed), []
    while time.monotonic() < stop - 2.0:
        asked.append(threading.Thread(target=interactive))
        asked[-1].start()
        time.sleep(rng.expovariate(rate))
    for t in threads + asked:
        t.join(180)
    ttfts.sort()
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "ttft_max": ttfts[-1], "interactive": len(ttfts),
            "batch_tokens_per_s": batch_tokens[0] / seconds,
            "engine_waiting_mean": statistics.mean(s[0] for s in samples),
            "engine_waiting_max": max(s[0] for s in samples),
            "gateway_waiting_mean": statistics.mean(s[1] for s in samples),
            "gateway_waiting_max": max(s[1] for s in samples)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch-clients", type=int, default=12)
    parser.add_argument("--interactive-rate", type=float, default=2.0)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="flow-real-"))
    model = write_tiny_llama(tmp / "tiny")
    spec = VllmSpec(("--max-num-seqs", "4"))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    with vllms(model, spec, spec) as engines:
        urls = [e.url for e in engines]
        for r in range(args.rounds):
            for name, flow in SETTINGS.items():
                config = {"models": [{"name": "tiny", "replicas": [
                    {"url": u, "engine": "vllm"} for u in urls]}],
                    "scheduling": {"signals_interval": 0.1, "signals_max_age": 10},
                    "flow_control": flow}
                with gateway_server(tmp, config) as (gateway, _):
                    result = run(gateway, urls, args.seconds, args.batch_clients,
                                 args.interactive_rate, seed=r)
                results[name].append(result)
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in result.items()), file=sys.stderr, flush=True)
    keys = ("ttft_p50", "ttft_p90", "ttft_max", "batch_tokens_per_s", "engine_waiting_mean",
            "engine_waiting_max", "gateway_waiting_mean", "gateway_waiting_max")
    print(f"2 x vLLM 0.32 CPU (tiny Llama, --max-num-seqs 4); {args.batch_clients} batch "
          f"clients, interactive {args.interactive_rate:g}/s; {args.rounds} rounds of "
          f"{args.seconds:g} s each; mean (min-max over rounds)\n")
    print("| setting | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, runs in results.items():
        cells = [f"{statistics.mean(r[k] for r in runs):.3f} ({min(r[k] for r in runs):.3f}-"
                 f"{max(r[k] for r in runs):.3f})" for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
