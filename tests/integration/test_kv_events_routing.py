"""Precise prefix routing end to end on simulated vLLM replicas publishing vLLM's KV events:
the gateway sends a prefix where an engine holds it even when it never sent it there itself
(another client, another gateway instance), which the approximate index cannot know; and a
replica whose events stop falls back."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from scrape import by_label, metric_sum
from support import gateway_server, sim, wait_until

MODEL = "m"
V1 = ("--profile", "llama3-8b-h100-vllm-v1", "--prefix-cache", "--speed", "50")
SYSTEM = " ".join(["the gateway routes each prompt to the replica whose cache holds it"] * 40)


@contextlib.contextmanager
def fleet(model_dir: Path, tmp: Path, events: bool) -> Iterator[tuple[str, list[str]]]:
    with sim("vllm", MODEL, 8192, "--tokenizer", str(model_dir), *V1, kv_events=True) as a, \
            sim("vllm", MODEL, 8192, "--tokenizer", str(model_dir), *V1, kv_events=True) as b:
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir), "replicas": [
            {"url": a, "engine": "vllm", "name": "a"}, {"url": b, "engine": "vllm", "name": "b"}]}],
            "kv_events": {"enabled": events, "stale_after": 2.0},
            "health": {"interval": 0.5, "timeout": 2.0}}
        with gateway_server(tmp, config) as (gw, _):
            yield gw, [a, b]


def complete(base: str, prompt: str) -> httpx.Response:
    response = httpx.post(base + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("events", [True, False])
def test_a_prefix_another_client_cached_draws_its_requests_only_with_events(
        model_dir: Path, tmp_path: Path, events: bool) -> None:
    with fleet(model_dir, tmp_path, events) as (gw, (a, b)):
        if events:
            wait_until(lambda: metric_sum(gw, "llm_gateway_kv_events_live") == 2, 20, "live")
        complete(b, SYSTEM + " first question")  # straight to b: the gateway never saw it
        if events:
            wait_until(lambda: by_label(gw, "llm_gateway_kv_index_blocks", "replica")
                       .get("b", 0) > 0, 20, "b's blocks known")
        served = [complete(gw, SYSTEM + f" question {i}").headers["x-gateway-replica"]
                  for i in range(8)]
        if events:
            assert set(served) == {"b"}, served  # idle replicas: only the cache decides
        else:  # a guess from what this gateway sent: the first goes anywhere
            assert len(set(served)) <= 2 and served[1:] == [served[1]] * 7, served


def test_a_replica_whose_events_stop_falls_back_to_the_approximate_index(
        model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path, True) as (gw, (a, b)):
        wait_until(lambda: metric_sum(gw, "llm_gateway_kv_events_live") == 2, 20, "live")
        # The publishers stop announcing (their batches are kept for replay only).
        for url in (a, b):
            httpx.post(url + "/sim/faults", json={"kv_skip": 1000}, timeout=5)
        served = {complete(gw, SYSTEM + f" q{i} " + "new words " * (i + 40))
                  .headers["x-gateway-replica"] for i in range(6)}
        # Each replica sent blocks it never announced is routed on the approximate index;
        # silence alone (an idle engine) changes nothing.
        wait_until(lambda: {r for r, live in by_label(gw, "llm_gateway_kv_events_live",
                                                      "replica").items() if live == 0}
                   == served, 20, "the replicas sent work fall back")
        for i in range(4):  # still served
            complete(gw, SYSTEM + f" later {i}")
