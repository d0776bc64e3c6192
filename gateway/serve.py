"""Run the gateway from a config file (YAML; every key also settable as GATEWAY_*).

Replicas are listed as {url, engine}, {host, gpus, base_port, engine} (one per GPU) or
{dns, port, engine} (one per address the name resolves to, re-resolved every dns.interval
seconds: a Kubernetes headless Service). Full reference: docs/index.md ("Running it") and docs/deploy.md.
An `auth` section turns on API keys and per-key limits (docs/keys-and-limits.md "API keys and limits";
secrets from `llm-gateway keys new`).

Example:
  llm-gateway serve --config gateway.yaml --port 8080 --workers 2
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import uvicorn

from gateway import observe
from gateway.app import CONFIG_ENV, create_app
from gateway.config import ConfigError, load_settings
from gateway.metrics import prepare_multiprocess_dir

log = logging.getLogger("gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (docs/index.md); env GATEWAY_* overrides")
    parser.add_argument("--host", help="listen address (default: config `host`, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default: config `port`, 8080)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes (default 1); with redis_url they balance on "
                             "one shared view of load, without it each balances blind to the "
                             "others (warned)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def uvicorn_options(host: str, port: int, log_level: str) -> dict[str, Any]:
    # No proxy-headers middleware: the gateway never reads the client's address, and every
    # layer on the request path costs CPU per request.
    return dict(host=host, port=port, log_level=log_level, access_log=False, loop="uvloop",
                http="httptools", timeout_graceful_shutdown=30, proxy_headers=False)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(args.config)
        observe.check(settings)
    except ConfigError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 2
    host = args.host or settings.host
    port = args.port if args.port is not None else settings.port
    common = uvicorn_options(host, port, args.log_level)
    if args.workers > 1:
        if settings.redis_url is None:
            log.warning("%d workers without redis_url: each worker balances on its own view of "
                        "load, blind to the others' requests (they can pile long prompts onto "
                        "one GPU); set redis_url to share load between them", args.workers)
            if settings.auth is not None:
                log.warning("%d workers without redis_url: each worker enforces API key limits "
                            "on its own (up to %d x each limit) and keeps its own admin-created "
                            "keys; set redis_url to share them", args.workers, args.workers)
        if args.config:
            os.environ[CONFIG_ENV] = os.path.abspath(args.config)
        # One scrape, every worker's totals: prometheus_client's multiprocess files.
        cleanup = prepare_multiprocess_dir()
        try:
            uvicorn.run("gateway.app:create_app_from_env", factory=True, workers=args.workers,
                        **common)
        finally:
            cleanup()
    else:
        uvicorn.run(create_app(settings), **common)
    return 0
