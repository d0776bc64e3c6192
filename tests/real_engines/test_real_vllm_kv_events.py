"""Precise prefix-cache routing on two real vLLM engines (CPU build) publishing KV events.

Each engine has a KV cache of 64 blocks of 32 tokens (``--num-gpu-blocks-override 64``): room
for three of the six tenants' 512-token system prompts, so the six fit the fleet but not one
engine, and an engine sent more evicts. Requests come through two gateway instances at once
(as behind any load balancer), alternating: an index that only remembers what this instance
sent cannot know what the other one put where, nor what the engine evicted; the engines'
events tell both. What counts is the engines' own ``vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total``, per row, with the caches emptied between rows
(``/reset_prefix_cache``: the engines announce ``AllBlocksCleared``).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engines import Engine, VllmSpec, restart, vllms
from scrape import by_label, metric_sum
from support import free_port, gateway_server, wait_until
from gateway.tokens import ModelTokenizer

BLOCK = 32
TENANTS = 6
PREFIX_BLOCKS = 16  # 512 tokens: three tenants fill an engine's 64 blocks with room to run
REQUESTS_PER_TENANT = 16
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


def kv_flags(port: int, replay: int) -> tuple[str, ...]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
    return ("--enable-prefix-caching", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", "64", "--kv-events-config", json.dumps(config))


@pytest.fixture(scope="module")
def fleet(tiny_model: Path) -> Iterator[list[tuple[Engine, int, int]]]:
    ports = [(free_port(), free_port()) for _ in range(2)]
    with vllms(tiny_model, *(VllmSpec(kv_flags(*p), env={"VLLM_SERVER_DEV_MODE": "1"})
                             for p in ports)) as engines:
        yield [(e, *p) for e, p in zip(engines, ports)]


@pytest.fixture(scope="module")
def tenants(tiny_model: Path) -> list[str]:
    """Six system prompts of at least PREFIX_BLOCKS full blocks each (with BOS)."""
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    rng = random.Random(7)
    words = "gpu cache block prefix tenant engine replica stream token batch decode".split()
    out = []
    for k in range(TENANTS):
        text = f"You are the assistant of tenant {k}."
        while len(tokenizer.encode(text)) < PREFIX_BLOCKS * BLOCK + 8:
            text += " " + rng.choice(words)
        out.append(text)
    return out


def config(fleet: list[tuple[Engine, int, int]], tiny_model: Path, balancer: str,
           events: bool, **scheduling: float) -> dict:
    return {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "replicas": [
        {"url": e.url, "engine": "vllm", "name": name,
         **({"kv_events": f"tcp://127.0.0.1:{port}", "kv_replay": f"tcp://127.0.0.1:{replay}"}
            if events else {})}
        for (e, port, replay), name in zip(fleet, "ab")]}],
        "balancer": balancer, "kv_events": {"enabled": events}, "scheduling": scheduling,
        "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 2}}


@contextlib.contextmanager
def gateways(tmp: Path, settings: dict, count: int = 2) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(gateway_server(tmp, settings))[0] for _ in range(count)]


def ask(base: str, tenant: str, question: str) -> httpx.Response:
    response = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": f"{tenant} Question: {question}", "max_tokens": 2,
        "temperature": 0})
    assert response.status_code == 200, response.text
    return response


def reset(fleet: list[tuple[Engine, int, int]]) -> None:
    for engine, _, _ in fleet:
        assert httpx.post(engine.url + "/reset_prefix_cache", timeout=30).status_code == 200


def workload(tenants: list[str]) -> list[tuple[int, str]]:
    rng = random.Random(11)
    order = [(k, f"number {i} of tenant {k}: {rng.random()}") for k in range(TENANTS)
             for i in range(REQUESTS_PER_TENANT)]
    rng.shuffle(order)
    return order


def hit_share(fleet, send) -> tuple[float, float]:  # noqa: ANN001
    """The engines' own prefix hit share over one run of the workload, and its wall time."""
    reset(fleet)
    before = [(e.metric(HITS), e.metric(QUERIES)) for e, _, _ in fleet]
    started = time.monotonic()
    send()
    seconds = time.monotonic() - started
    after = [(e.metric(HITS), e.metric(QUERIES)) for e, _, _ in fleet]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return hits / queries, seconds


def test_precise_routing_keeps_each_prefix_where_the_engines_hold_it(
        fleet, tenants, tiny_model: Path, tmp_path: Path) -> None:
    order = workload(tenants)
    shares = {}

    def through(bases: list[str], events: bool = False) -> None:
        for i, (k, question) in enumerate(order):
            seen = [metric_sum(b, "llm_gateway_kv_events_total") for b in bases] if events else []
            ask(bases[i % len(bases)], tenants[k], question)
            # The next request comes once the gateways heard this one's KV events (up to a
            # quarter second), as it would at a production rate. On a machine loaded by
            # other tests the events came after it (0.80 against 0.87 alone): that measured
            # the machine's lag, not the routing.
            deadline = time.monotonic() + 0.25
            while seen and time.monotonic() < deadline and any(
                    metric_sum(b, "llm_gateway_kv_events_total") <= n
                    for b, n in zip(bases, seen)):
                time.sleep(0.01)

    def pinned() -> None:  # the best a router can do: three tenants on each engine
        for k, question in order:
            ask(fleet[k % 2][0].url, tenants[k], question)

    shares["pinned"] = hit_share(fleet, pinned)

    # (Round robin, 0.55 in every run, is no longer run: the approximate index is the
    # stronger baseline, and the suite's time goes to what it proves.)
    for row, balancer, events, weights in (
            ("approximate", "least_expected_work", False, {}),
            ("precise", "least_expected_work", True, {})):
        with gateways(tmp_path, config(fleet, tiny_model, balancer, events, **weights)) as bases:
            if events:
                for base in bases:
                    wait_until(lambda: metric_sum(base, "llm_gateway_kv_events_live") == 2, 30,
                               "both replicas' events live")
            shares[row] = hit_share(fleet, lambda: through(bases, events))
            if events:
                assert all(metric_sum(b, "llm_gateway_kv_events_total") > 0 for b in bases)
                assert metric_sum(bases[0], "llm_gateway_kv_events_dropped_total") == 0
                # What the index predicted where it sent, beside what the engines found.
                sent = len(order) // len(bases)
                wait_until(lambda: all(metric_sum(b, "llm_gateway_kv_prefix_prompt_tokens_total")
                                       >= sent * PREFIX_BLOCKS * BLOCK for b in bases), 10,
                           "the figures published")
                predicted = (sum(metric_sum(b, "llm_gateway_kv_prefix_predicted_tokens_total")
                                 for b in bases)
                             / sum(metric_sum(b, "llm_gateway_kv_prefix_prompt_tokens_total")
                                   for b in bases))
                print("predicted hit share:", round(predicted, 3))
                assert abs(predicted - shares[row][0]) < 0.05, (predicted, shares[row])
    print("prefix hit share, wall seconds:", {k: (round(s, 3), round(t, 1))
                                              for k, (s, t) in shares.items()})
    share = {k: s for k, (s, _) in shares.items()}
    # Measured (2026-11-27): pinned 0.87 in every run; approximate 0.71 to 0.80; round robin
    # 0.55. Precise without churn_weight: 0.79, 0.87, 0.87, 0.79, 0.80 (a prefix nobody held
    # went to a random tie, and one engine took more tenants than it holds); with it (the
    # default): 0.87, 0.87.
    assert share["precise"] > share["approximate"], shares
    assert share["precise"] >= share["pinned"] - 0.05, shares


def test_an_evicted_prefix_stops_drawing_requests_and_a_restart_empties_the_index(
        fleet, tenants, tiny_model: Path, tmp_path: Path) -> None:
    reset(fleet)
    (a, _, _), (b, _, _) = fleet
    with gateways(tmp_path, config(fleet, tiny_model, "least_expected_work", True), 1) as (gw,):
        wait_until(lambda: metric_sum(gw, "llm_gateway_kv_events_live") == 2, 30, "live")
        ask(a.url, tenants[0], "warm a")  # both engines hold tenant 0's prefix
        ask(b.url, tenants[0], "warm b")
        wait_until(lambda: all(v >= PREFIX_BLOCKS for v in by_label(
            gw, "llm_gateway_kv_index_blocks", "replica").values()), 30, "index learned")
        # Other prompts fill engine a's cache: tenant 0's blocks are evicted there.
        removed = metric_sum(gw, "llm_gateway_kv_events_total", replica="a", type="BlockRemoved")
        for k in range(1, 5):
            ask(a.url, tenants[k], "evict")
        wait_until(lambda: metric_sum(gw, "llm_gateway_kv_events_total", replica="a",
                                      type="BlockRemoved") > removed, 30, "a evicts")
        served = {ask(gw, tenants[0], f"after {i}").headers["x-gateway-replica"]
                  for i in range(6)}
        assert served == {"b"}, served  # idle fleet: only the cached prefix decides

        # Engine b restarts with an empty cache: the gateway forgets what b held.
        b.kill()
        restart(b)
        wait_until(lambda: metric_sum(gw, "llm_gateway_kv_index_cleared_total",
                                      replica="b") >= 1, 60, "b's index cleared")
        wait_until(lambda: metric_sum(gw, "llm_gateway_kv_events_live", replica="b") == 1, 60,
                   "b live again")
        assert metric_sum(gw, "llm_gateway_kv_index_blocks", replica="b") == 0
        predicted = metric_sum(gw, "llm_gateway_kv_prefix_predicted_tokens_total")
        prompted = metric_sum(gw, "llm_gateway_kv_prefix_prompt_tokens_total")
        ask(gw, tenants[0], "after the restart")  # held nowhere now
        wait_until(lambda: metric_sum(gw, "llm_gateway_kv_prefix_prompt_tokens_total")
                   > prompted, 10, "the request's figures published")
        assert metric_sum(gw, "llm_gateway_kv_prefix_predicted_tokens_total") == predicted
