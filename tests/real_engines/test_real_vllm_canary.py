"""Shadow traffic between two real vLLM engines on the same weights: fp32 serves the clients,
a bf16 copy shadows all of it. Every pair is compared or counted as dropped, with its reason;
greedy agreement between the two dtypes is measured (random weights make it well below 1),
and the verdict judges it."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from engines import Engine, VllmSpec, vllms
from support import gateway_server, wait_for_value, wait_until

ADMIN = {"authorization": "Bearer real"}


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[dict[str, Engine]]:
    with vllms(tiny_model, VllmSpec(dtype="float32"), VllmSpec(dtype="bfloat16")) as (fp32, bf16):
        yield {"fp32": fp32, "bf16": bf16}


@pytest.fixture(scope="module")
def gateway(engines: dict[str, Engine], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "pools": [
        {"name": "fp32", "replicas": [{"url": engines["fp32"].url, "name": "fp32-0"}]},
        {"name": "bf16", "shadow_of": "fp32", "sample": 1.0,
         "replicas": [{"url": engines["bf16"].url, "name": "bf16-0"}]}]}],
        "admin_token": "real", "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3},
        "canary": {"max_shadow_in_flight": 256}}
    with gateway_server(tmp_path_factory.mktemp("real-canary"), config) as (url, _):
        yield url


def report(gateway: str) -> dict[str, Any]:
    answer = httpx.get(gateway + "/admin/canary/tiny/disagreements", headers=ADMIN)
    assert answer.status_code == 200
    return answer.json()["pools"].get("bf16", {"compared": 0, "dropped": {}})


def accounted(pool: dict[str, Any]) -> int:
    return pool["compared"] + sum(pool["dropped"].values())


def test_every_shadowed_pair_is_compared_or_dropped(gateway: str,
                                                    engines: dict[str, Engine]) -> None:
    """200 greedy requests, streamed and whole, four at a time: each has its pair judged.
    (Streams whose first text arrives with their last token, common with these random
    weights' byte tokens, once lost their pair without a count.)"""
    shapes = [
        ("/v1/completions", {"prompt": "tell me a story", "stream": True}),
        ("/v1/completions", {"prompt": "tell me a story", "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": "tell me a story"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    before = accounted(report(gateway))
    failures: list[str] = []
    lock = threading.Lock()
    work = list(range(200))

    def worker() -> None:
        with httpx.Client(timeout=60) as client:
            while True:
                with lock:
                    if not work:
                        return
                    i = work.pop()
                path, extra = shapes[i % len(shapes)]
                body = {"model": "tiny", "temperature": 0, "max_tokens": 4 + i % 13, **extra}
                if "prompt" in body:
                    body["prompt"] = f"{body['prompt']} {i}"
                answer = client.post(gateway + path, json=body)
                if answer.status_code != 200:
                    with lock:
                        failures.append(answer.text)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures
    wait_until(lambda: accounted(report(gateway)) - before >= 200, 60,
               lambda: report(gateway), every=0.2)
    pool = report(gateway)
    assert accounted(pool) - before == 200, pool
    assert pool["greedy_compared"] == pool["compared"] > 0
    # fp32 and bf16 of random weights disagree on some greedy answers, agree on others.
    assert 0 < pool["greedy_agreed"] < pool["greedy_compared"], pool
    assert engines["bf16"].metric("vllm:request_success_total") >= 200


def test_the_verdict_judges_the_agreement_the_pairs_measured(gateway: str) -> None:
    """The verdict's agreement row (issue 29): the greedy pairs' counts, a Wilson interval,
    the class its floor gives; critical, so a failing agreement fails the canary."""
    def send(i: int) -> None:
        body = {"model": "tiny", "temperature": 0, "max_tokens": 24, "stream": i % 2 == 0,
                "prompt": f"Tell me about the number {i}."}
        with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            r.read()

    before = accounted(report(gateway))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(send, range(60)))
    pairs = wait_for_value(lambda: report(gateway),  # copies end after primaries
                           lambda p: accounted(p) - before >= 60, 60, "60 more pairs",
                           every=0.2)
    result = httpx.get(gateway + "/admin/canary/tiny?canary=bf16", headers=ADMIN).json()
    agreement = next(m for m in result["metrics"] if m["metric"] == "agreement")
    assert agreement["pairs"]["greedy_compared"] == pairs["greedy_compared"]
    assert agreement["pairs"]["agreed"] == pairs["greedy_agreed"]
    assert agreement["canary_rate"] == pairs["greedy_agreed"] / pairs["greedy_compared"]
    low, high = agreement["canary_ci"]
    assert low <= agreement["canary_rate"] <= high
    floor = agreement["threshold"]
    assert agreement["class"] == ("fail" if high < floor else
                                  "marginal" if agreement["canary_rate"] < floor else "pass")
    assert agreement["critical"]
    if agreement["class"] == "fail":
        assert result["verdict"] == "fail"
