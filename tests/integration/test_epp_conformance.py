"""The Gateway API Inference Extension's conformance tests that apply to an endpoint picker
without a Kubernetes cluster (its conformance/tests/, at the commit tests/crds/README.md
names), ported to Envoy 1.40 + ``llm-gateway epp`` + simulated replicas:

- GatewayFollowingEPPRouting (and its data-parallel variant: several ports on one IP, as
  every replica here is 127.0.0.1:port): every request lands on the endpoint the picker
  named, none elsewhere;
- GatewayDestinationEndpointServed: the endpoint that served is reported back to the
  picker (test_epp_envoy: the reservation follows a retry to the fallback; test_epp_protocol:
  the served report read from ``envoy.lb`` metadata);
- EppUnAvailableFailOpen, in the mode this picker's Envoy config runs (fail closed, GIE's
  default ``failureMode: FailClose``): with the picker gone, Envoy answers an error and no
  request reaches a replica unplaced.

The others need a cluster's control plane: InferencePool and HTTPRoute status conditions
(inferencepool_accepted, _resolvedrefs_condition, _invalid_epp_service, _missing_epp_ref,
httproute_invalid_inferencepool_ref), ports and appProtocol validation
(inferencepool_httproute_port_validation, inferencepool_appprotocol), and routing between
several pools or gateways (gateway_weighted_two_pools, inferencepool_multiple_rules_different_pools,
httproute_multiple_gateways_different_pools). Their manifests' shapes are checked against the
CRDs in tests/e2e/test_kubernetes_epp.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from epp_support import envoy, held, picker
from scrape import by_label
from support import sim, stop, wait_until

MODEL = "sim-model"
SLOW = ("--profile", "paced", "--ttft-ms", "60000", "--itl-ms", "20")  # no token while held


def engine_holds(url: str) -> int:
    state = httpx.get(url + "/sim/state", timeout=5).json()
    return state["running"] + state["waiting"]


def settings(*urls: str) -> dict:
    return {"models": [{"name": MODEL, "replicas": [{"url": u, "engine": "vllm"}
                                                   for u in urls]}],
            "health": {"interval": 30}}


def test_gateway_following_epp_routing(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 2048, *SLOW) as a, sim("vllm", MODEL, 2048, *SLOW) as b, \
            sim("vllm", MODEL, 2048, *SLOW) as c, picker(tmp_path, settings(a, b, c)) as p, \
            envoy(tmp_path, [a, b, c], [p.grpc]) as proxy, contextlib.ExitStack() as stack:
        for n, tokens in enumerate([300, 20, 150, 80, 400, 10, 60], 1):
            stack.callback(held(proxy.url, {"model": MODEL, "prompt": "hi",
                                            "max_tokens": tokens, "stream": True}).close)
            # Each replica holds exactly what the picker placed on it: Envoy went where the
            # picker said, every time.
            wait_until(lambda: {u.split("//")[1]: float(engine_holds(u)) for u in (a, b, c)}
                       == by_label(p.url, "llm_gateway_replica_in_flight_requests", "replica")
                       and sum(engine_holds(u) for u in (a, b, c)) == n, 10,
                       f"request {n} where the picker placed it")
        assert sum(1 for u in (a, b, c) if engine_holds(u)) == 3  # the picks spread


def test_epp_unavailable_fails_closed(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 2048) as a, picker(tmp_path, settings(a)) as p, \
            envoy(tmp_path, [a], [p.grpc]) as proxy:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(proxy.url + "/v1/completions", json=body, timeout=10).status_code == 200
        served = _served(a)
        assert served >= 1
        stop(p.proc)
        for _ in range(3):
            reply = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
            assert reply.status_code >= 500
        assert _served(a) == served  # nothing reached the replica unplaced


def _served(url: str) -> float:
    """Requests the simulated vLLM finished (its own counter)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total
