"""The canary on real engines: the tiny Llama in fp32 (the baseline) and in bf16 (a shadow of
it) behind one gateway. Every shadowed pair of greedy requests, streamed and whole, is
compared or counted as dropped, and the verdict judges the agreement the pairs measured."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engines import vllm
from support import gateway_server

TOKEN = "real-canary"
AUTH = {"authorization": f"Bearer {TOKEN}"}
N = 40


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with vllm(tiny_model) as fp32, vllm(tiny_model, dtype="bfloat16") as bf16:
        config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "pools": [
            {"name": "stable", "replicas": [{"url": fp32.url, "name": "fp32"}]},
            {"name": "bf16", "shadow_of": "stable", "sample": 1.0,
             "replicas": [{"url": bf16.url, "name": "bf16"}]}]}],
            "health": {"interval": 0.5, "timeout": 2.0}, "admin_token": TOKEN,
            "canary": {"judge": {"min_samples": 20}}}
        with gateway_server(tmp_path_factory.mktemp("real-canary"), config) as (url, _):
            yield url


def send(gateway: str, i: int) -> None:
    """Greedy, 24 tokens: completions and chat, streamed and whole, in turn."""
    stream, chat = i % 2 == 0, (i // 2) % 2 == 0
    text = f"Tell me about the number {i}."
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "stream": stream,
            **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", gateway + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        response.read()


def test_every_pair_is_accounted_for_and_the_verdict_judges_agreement(gateway: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: send(gateway, i), range(N)))
    deadline = time.monotonic() + 120
    while True:  # the copies end after the primaries
        pairs = httpx.get(f"{gateway}/admin/canary/tiny/disagreements",
                          headers=AUTH).json()["pools"].get("bf16", {})
        ended = pairs.get("compared", 0) + sum(pairs.get("dropped", {}).values())
        if ended == N or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ended == N, pairs  # each pair compared or counted as dropped, none vanished
    assert pairs["compared"] == pairs["greedy_compared"] >= N - 2, pairs
    result = httpx.get(f"{gateway}/admin/canary/tiny?canary=bf16", headers=AUTH).json()
    agreement = next(m for m in result["metrics"] if m["metric"] == "agreement")
    assert agreement["pairs"]["greedy_compared"] == pairs["compared"]
    assert agreement["pairs"]["agreed"] == pairs["greedy_agreed"]
    assert agreement["canary_rate"] == pairs["greedy_agreed"] / pairs["compared"]
    low, high = agreement["canary_ci"]
    assert low <= agreement["canary_rate"] <= high
    floor = agreement["threshold"]
    assert agreement["class"] == ("fail" if high < floor else
                                  "marginal" if agreement["canary_rate"] < floor else "pass")
    assert agreement["critical"]  # by default: a failing agreement fails the canary
    if agreement["class"] == "fail":
        assert result["verdict"] == "fail"
