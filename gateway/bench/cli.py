"""Load-test an OpenAI or TGI endpoint: the gateway, or one engine directly.

Closed-loop concurrency sweeps (--concurrency 10,50,100: that many users, each sending its
next request when the last one ends) or open-loop Poisson arrivals (--rate 5,10: requests
per second, seeded, latency counted from each request's due time). Prompts and outputs of
fixed lengths, from distributions, or from a JSONL dataset; streaming or not.

Reports, per load level: TTFT p50/p90/p99, inter-token latency, end-to-end latency, output
tokens/s, requests/s and errors by kind, overall and per pool and replica when the gateway
names them (x-gateway-pool, x-gateway-replica). Output tokens come from the engine's usage
(OpenAI usage, TGI details) when the response has it, else from counted token events.
Every level is bounded by --requests and/or --duration, every request by --timeout. Only
the URL given is contacted.

lengths (--prompt-tokens, --output-tokens):
  N                 fixed
  uniform:LO:HI     uniform integers in [LO, HI]
  normal:MEAN:SD    normal, rounded, at least 1
  exp:MEAN          exponential, rounded, at least 1
  Synthetic prompts are random common words, one token each in most BPE vocabularies.

dataset (--dataset FILE.jsonl), one request per line:
  {"prompt": "...", "max_tokens": 128}            (or "inputs"; max_tokens optional)
  {"messages": [{"role": "user", "content": "..."}], "max_tokens": 64}

examples:
  llm-gateway bench http://127.0.0.1:8080 --stream --concurrency 10,50,100 --requests 500
  llm-gateway bench http://127.0.0.1:8080 --api tgi --stream --rate 5,10,20 --duration 60 \\
      --prompt-tokens uniform:100:2000 --output-tokens normal:256:64 --json out.json --plot out.png
  llm-gateway bench http://127.0.0.1:8000 --endpoint /v1/chat/completions --dataset prompts.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
import urllib.error
import urllib.request
from typing import Any

MAX_REQUESTS = 10_000_000
MAX_DURATION = 24 * 3600.0
DISTINCT_PROMPTS = 1000   # closed loops bounded only by time cycle through this many


def _levels(text: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _lengths(text: str):
    from gateway.bench.workload import Lengths
    try:
        return Lengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the target, e.g. http://127.0.0.1:8080; a path ending in "
                                    "an endpoint (/v1/chat/completions) is the endpoint, any "
                                    "other path (/v1, /proxy) a prefix of it")
    target = parser.add_argument_group("target")
    target.add_argument("--api", choices=("openai", "tgi"), default="openai",
                        help="wire format (default openai)")
    target.add_argument("--endpoint", help="request path (default /v1/completions for openai; "
                                           "/generate, or /generate_stream with --stream, for "
                                           "tgi; /v1/chat/completions sends messages)")
    target.add_argument("--stream", action="store_true", help="stream the responses (SSE)")
    target.add_argument("--model", help="model name for openai (default: the first of "
                                        "GET /v1/models)")
    target.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                        help="fields merged into every request body, e.g. "
                             "'{\"ignore_eos\": true}'")
    target.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per request (default 300)")
    load = parser.add_argument_group("load (one level per value; closed loop unless --rate)")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=lambda t: _levels(t, int), metavar="N[,N...]",
                       help="closed loop: users per level (default 10)")
    shape.add_argument("--rate", type=lambda t: _levels(t, float), metavar="R[,R...]",
                       help="open loop: Poisson arrivals, requests/s per level")
    load.add_argument("--requests", type=int, help="requests per level (default 100 unless "
                                                   "--duration is given)")
    load.add_argument("--duration", type=float, help="seconds per level (stop sending after)")
    load.add_argument("--max-in-flight", type=int, default=2048,
                      help="open loop: most requests in flight at once (default 2048)")
    load.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    work = parser.add_argument_group("workload")
    work.add_argument("--prompt-tokens", type=_lengths, default="128",
                      help="synthetic prompt length (default 128)")
    work.add_argument("--output-tokens", type=_lengths, default="128",
                      help="max_tokens / max_new_tokens (default 128)")
    work.add_argument("--dataset", help="JSONL file of requests (instead of synthetic prompts)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_out", metavar="FILE", help="write every figure as JSON")
    out.add_argument("--plot", metavar="FILE.png",
                     help="TTFT and throughput vs load (needs matplotlib)")
    progress = out.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="live progress line on stderr (default: when stderr is a tty)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")


def discover_model(models_url: str, timeout: float = 10.0) -> str:
    """The first model a GET /v1/models lists."""
    with urllib.request.urlopen(models_url, timeout=timeout) as r:
        data = json.load(r).get("data") or []
    if not data:
        raise ValueError("GET /v1/models lists no model")
    return str(data[0]["id"])


def run(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from gateway.bench import report
    from gateway.bench.loadgen import Target

    def fail(message: str) -> int:
        print(f"llm-gateway bench: error: {message}", file=sys.stderr)
        return 2

    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        return fail(f"--requests must be in [1, {MAX_REQUESTS}]")
    if args.duration is not None and not 0 < args.duration <= MAX_DURATION:
        return fail(f"--duration must be in (0, {MAX_DURATION:g}]")
    if args.timeout <= 0 or args.max_in_flight < 1:
        return fail("--timeout and --max-in-flight must be positive")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        return fail("--extra-body must be a JSON object")
    requests_per_level = args.requests or (None if args.duration else 100)
    try:
        target = Target(args.url, api=args.api, endpoint=args.endpoint, stream=args.stream,
                        model=args.model, extra_body=args.extra_body)
        requests = make_requests(args, requests_per_level)
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    model = args.model
    if args.api == "openai" and not model:
        parts = urlsplit(args.url)
        prefix = target.endpoint.partition("/v1/")[0] if "/v1/" in target.endpoint else ""
        models_url = f"{parts.scheme}://{parts.netloc}{prefix}/v1/models"
        try:
            target.model = model = discover_model(models_url)
        except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
            return fail(f"could not discover the model from {models_url} ({exc}); pass --model")

    use_uvloop()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    open_loop = args.rate is not None
    levels = args.rate if open_loop else (args.concurrency or [10])
    label = "rate" if open_loop else "concurrency"
    print(f"bench {target.url}{target.endpoint} ({args.api}{', stream' if args.stream else ''}"
          f"{f', model {model}' if model else ''}): {label} {','.join(f'{v:g}' for v in levels)}, "
          f"{requests_per_level or 'unbounded'} requests"
          f"{f' / {args.duration:g} s' if args.duration else ''} per level", file=sys.stderr)
    results: list[tuple[float, dict[str, Any]]] = []
    for level in levels:
        run_ = asyncio.run(one_level(target, requests, level, open_loop, requests_per_level,
                                     args, show))
        results.append((level, report.summarize(run_)))
    named = [(f"{label} {level:g}", s) for level, s in results]
    print(report.table(named, label="load"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"command": " ".join(["llm-gateway", *map(shlex.quote, sys.argv[1:])]),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "target": {"url": target.url, "endpoint": target.endpoint,
                                  "api": args.api, "stream": args.stream, "model": model},
                       "workload": {"dataset": args.dataset,
                                    "prompt_tokens": None if args.dataset else str(args.prompt_tokens),
                                    "output_tokens": str(args.output_tokens), "seed": args.seed,
                                    "requests_per_level": requests_per_level,
                                    "duration_per_level_s": args.duration},
                       "levels": [{label: level, **s} for level, s in results]}, f, indent=2)
        print(f"JSON: {args.json_out}", file=sys.stderr)
    if args.plot:
        print(report.plot(results, args.plot,
                          "requests/s (Poisson)" if open_loop else "concurrent users"),
              file=sys.stderr)
    if all(s["overall"]["ok"] == 0 for _, s in results):
        print("llm-gateway bench: every request failed", file=sys.stderr)
        return 1
    return 0


def use_uvloop() -> None:
    """uvloop when installed: the client then costs less CPU per request and per token."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def make_requests(args: argparse.Namespace, per_level: int | None) -> list:
    from gateway.bench.workload import load_dataset, synthetic_requests
    n = per_level or DISTINCT_PROMPTS
    if args.dataset:
        return load_dataset(args.dataset, args.output_tokens, args.seed)
    return synthetic_requests(n, args.prompt_tokens, args.output_tokens, args.seed)


async def one_level(target, requests: list, level: float, open_loop: bool,
                    per_level: int | None, args: argparse.Namespace, show: bool):
    from gateway.bench import report
    from gateway.bench.loadgen import closed_loop, open_loop as open_, poisson_arrivals

    name = f"rate {level:g}/s" if open_loop else f"{level:g} users"
    progress = report.Progress(name, per_level, args.duration)
    ticker = asyncio.ensure_future(progress.show()) if show else None
    try:
        if open_loop:
            n = per_level or math.ceil(level * args.duration * 1.5) + 10
            arrivals = poisson_arrivals(level, n, seed=args.seed)
            return await open_(target, requests, arrivals, duration=args.duration,
                               timeout=args.timeout, max_in_flight=args.max_in_flight,
                               on_record=progress, rate=level)
        return await closed_loop(target, requests, int(level), max_requests=per_level,
                                 duration=args.duration, timeout=args.timeout,
                                 on_record=progress)
    finally:
        if ticker is not None:
            ticker.cancel()
            try:
                await ticker
            except asyncio.CancelledError:
                pass
