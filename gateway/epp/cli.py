"""Run the gateway as an Endpoint Picker (EPP) for Envoy: an ext_proc gRPC server that admits
and places each request with the gateway's own parts (keys and limits, the window check,
the balancing policy and ledger, flow control, canary splits), while Envoy relays the bytes.

The config file is the gateway's (docs/index.md); its replicas are the endpoints picked
(their URLs must be ip:port, as Envoy dials them). The HTTP port serves /metrics, /health,
/ready and the admin API as the gateway does. With redis_url, several pickers share one
view of load and one set of key limits. Envoy's side: deploy/envoy/envoy.yaml; Kubernetes
(InferencePool): deploy/kubernetes/epp/. docs/envoy-epp.md says what the picker does and
does not do (no TGI translation, no stream fixes, no shadow copies).

Example:
  llm-gateway epp --config gateway.yaml --grpc-port 9002 --port 9090
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from gateway.app import create_app
from gateway.config import ConfigError, load_settings
from gateway.epp.bootstrap import render
from gateway.epp.exchange import endpoint_of
from gateway.fleet.membership import Fleet
from gateway.fleet.model import build_models
from gateway.serve import uvicorn_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (docs/index.md); env GATEWAY_* overrides")
    parser.add_argument("--host", help="listen address of both ports (default: config `host`)")
    parser.add_argument("--grpc-port", type=int, default=9002,
                        help="ext_proc gRPC port Envoy calls (default 9002, GIE's)")
    parser.add_argument("--port", type=int, default=9090,
                        help="HTTP port: /metrics, /health, /ready, admin API (default 9090)")
    parser.add_argument("--fallbacks", type=int, default=2,
                        help="endpoints named after the pick, for Envoy's retries (default 2)")
    parser.add_argument("--tls-cert", metavar="PEM",
                        help="serve the gRPC port with TLS: certificate chain (with --tls-key; "
                             "Envoy AI Gateway dials its picker with TLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    parser.add_argument("--health-port", type=int,
                        help="also serve the gRPC health services alone, in plaintext, on "
                             "this port (kubelet's gRPC probes, when the gRPC port has TLS)")
    parser.add_argument("--envoy-bootstrap", action="store_true",
                        help="print a bootstrap for Envoy in front of this config's replicas and "
                             "this picker, then exit (deploy/envoy/envoy.yaml is the demo's)")
    parser.add_argument("--envoy-port", type=int, default=8081,
                        help="with --envoy-bootstrap: Envoy's listener port (default 8081)")
    parser.add_argument("--envoy-admin-port", type=int, default=9901,
                        help="with --envoy-bootstrap: Envoy's admin port, on loopback "
                             "(default 9901)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 2
    host = args.host or settings.host
    if args.envoy_bootstrap:
        endpoints = [endpoint_of(r) for r in Fleet(build_models(settings)).replicas]
        if not endpoints:
            print("llm-gateway: no replica with a url or host in the config (dns: entries "
                  "resolve at run time: list the endpoints in Envoy's cluster yourself)",
                  file=sys.stderr)
            return 2
        address = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{args.grpc_port}"
        print(render(endpoints, args.envoy_port, [address], args.envoy_admin_port), end="")
        return 0
    from gateway.epp.server import Listen, beside  # grpc: loaded only by this command

    if (args.tls_cert is None) != (args.tls_key is None):
        print("llm-gateway: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    try:
        tls = (None if args.tls_cert is None else
               (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes()))
    except OSError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 2
    picker = beside(Listen(host, args.grpc_port, args.fallbacks, tls, args.health_port),
                    settings.drain_timeout)
    # uvloop, as the gateway: grpc's asyncio server runs on it too.
    uvicorn.run(create_app(settings, beside=picker),
                **uvicorn_options(host, args.port, args.log_level))
    return 0
