"""The default policy through the real gateway: a shared system prompt and a session each keep
landing on one replica (x-gateway-replica), while unrelated requests spread."""

from __future__ import annotations

from pathlib import Path

import httpx

from support import gateway_server, sim

SYSTEM = "You are the support assistant of a bicycle shop. Answer politely. " * 40


def replicas_used(base: str, bodies: list[dict],
                  headers: dict[str, str] | None = None) -> list[str]:
    used = []
    with httpx.Client(base_url=base, timeout=30) as client:
        for body in bodies:
            response = client.post("/v1/completions", json=body, headers=headers or {})
            assert response.status_code == 200, response.text
            used.append(response.headers["x-gateway-replica"])
    return used


def test_prefix_and_session_affinity_through_the_gateway(tmp_path: Path) -> None:
    with sim("vllm", "m", 8192, "--profile", "instant") as a, \
            sim("vllm", "m", 8192, "--profile", "instant") as b:
        config = {"models": [{"name": "m", "replicas": [{"url": a, "engine": "vllm"},
                                                        {"url": b, "engine": "vllm"}]}]}
        with gateway_server(tmp_path, config) as (base, _):
            shared = [{"model": "m", "prompt": SYSTEM + f"Question {i}?", "max_tokens": 4}
                      for i in range(12)]
            assert len(set(replicas_used(base, shared))) == 1

            short = [{"model": "m", "prompt": f"hello {i}", "max_tokens": 4} for i in range(12)]
            assert len(set(replicas_used(base, short, {"x-session-id": "alice"}))) == 1
            as_user = [{**body, "user": "bob"} for body in short]
            assert len(set(replicas_used(base, as_user))) == 1
            # no prefix, no session: ties are broken at random (2 * 0.5^24 to fail)
            assert len(set(replicas_used(base, short + short))) == 2
