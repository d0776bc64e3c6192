"""Two endpoint pickers behind one Envoy (each request's ext_proc stream goes to one of
them, round robin), sharing the ledger through a real Redis as gateway instances do: both
see every request's reservation, whichever placed it, so the second request of a pair goes
to the replica the first one left idle even when the other picker placed the first."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from epp_support import envoy, held, picker
from redis_support import SHARED_URL, shared_prefix
from scrape import by_label
from support import sim, wait_until

MODEL = "sim-model"
ADMIN = "admin-token-0123456789abcdef"
SLOW = ("--profile", "paced", "--ttft-ms", "60000", "--itl-ms", "20")  # no token while held


def own_in_flight(url: str) -> float:
    """The requests this picker placed itself (its metrics count its own share)."""
    return sum(by_label(url, "llm_gateway_replica_in_flight_requests", "replica").values())


def fleet_view(url: str) -> dict[str, tuple[int, int]]:
    """The load this picker balances on, the fleet's (admin API): replica -> (outstanding
    tokens, requests in flight)."""
    replicas = httpx.get(url + "/admin/replicas", headers={"authorization": f"Bearer {ADMIN}"},
                         timeout=5).json()["replicas"]
    return {r["name"]: (r["outstanding_tokens"], r["in_flight"]) for r in replicas}


def streams_per_picker(admin: str) -> list[int]:
    """How many ext_proc streams Envoy sent each picker (its cluster's per-host counts)."""
    text = httpx.get(admin + "/clusters", timeout=5).text
    return [int(line.rsplit("::", 1)[1]) for line in text.splitlines()
            if line.startswith("picker::") and "::rq_total::" in line]


def test_two_pickers_share_one_view_of_the_load(tmp_path: Path) -> None:
    with shared_prefix() as prefix, sim("vllm", MODEL, 2048, *SLOW) as a, \
            sim("vllm", MODEL, 2048, *SLOW) as b:
        config = {"models": [{"name": MODEL, "replicas": [{"url": u, "engine": "vllm"}
                                                         for u in (a, b)]}],
                  "health": {"interval": 30}, "redis_url": SHARED_URL, "admin_token": ADMIN,
                  "redis_key_prefix": prefix, "redis_sync_interval": 0.05}
        with picker(tmp_path, config) as one, picker(tmp_path, config) as two, \
                envoy(tmp_path, [a, b], [one.grpc, two.grpc]) as proxy, \
                contextlib.ExitStack() as stack:
            for n, tokens in enumerate([400, 300, 200, 100], 1):
                stack.callback(held(proxy.url, {"model": MODEL, "prompt": "hi",
                                                "max_tokens": tokens, "stream": True}).close)
                # Both pickers balance on all n requests, whichever placed them: one view.
                wait_until(lambda: fleet_view(one.url) == fleet_view(two.url)
                           and sum(f for _, f in fleet_view(one.url).values()) == n, 10,
                           lambda: f"one view after request {n}: {fleet_view(one.url)} "
                                   f"vs {fleet_view(two.url)}")
            # Each placed some of them (Envoy spread the streams over both) ...
            assert own_in_flight(one.url) >= 1 and own_in_flight(two.url) >= 1
            assert own_in_flight(one.url) + own_in_flight(two.url) == 4
            assert all(n >= 1 for n in streams_per_picker(proxy.admin))
            # ... and each pick went where the fleet's load was lowest: 400 | 300, then 200
            # on the 300 side, then 100 on the 400 side: both replicas at 500 (+ prompts).
            final = sorted(tokens for tokens, _ in fleet_view(one.url).values())
            assert final[1] - final[0] <= 10, final
