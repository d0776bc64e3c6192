"""Disaggregated prefill/decode on real vLLM (CPU build) through the gateway.

Two engines share a KV store through vLLM's ``ExampleConnector`` (a directory). The gateway
prefills each prompt on the prefill engine (one token, ``do_remote_decode``) and streams the
answer from the decode engine, which loads the prompt's KV instead of computing it (its
counter ``vllm:external_prefix_cache_hits_total``: the tokens its connector loaded). Greedy
output through the pair equals the prefill engine's own when it serves the same request
whole, token for token. Killing the prefill engine mid-run costs no request: the decode
engine prefills for itself meanwhile. ``NixlConnector``, the connector GPU fleets use, runs
here too: ``test_real_vllm_nixl.py`` (opt-in).
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from engines import Engine, VllmSpec, vllms
from scrape import by_label, metric_sum
from support import gateway_server, wait_until

LOADED = "vllm:external_prefix_cache_hits_total"
BLOCK = 32


def loaded(prompt_tokens: int) -> int:
    """The tokens the decode engine's ExampleConnector loads for a prompt the prefill engine
    stored. vLLM 0.32's example rounds twice (``align_to_block_size(n)`` is ``(n - 1) //
    block * block``): it stores ``align(p)`` tokens and looks for ``align(p - 1)``, so a
    prompt of 32k + 1 tokens is stored under a key never looked up, and recomputed."""
    stored, wanted = (prompt_tokens - 1) // BLOCK * BLOCK, (prompt_tokens - 2) // BLOCK * BLOCK
    return wanted if stored == wanted else 0


def connector_flags(store: Path) -> tuple[str, ...]:
    config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return ("--kv-transfer-config", json.dumps(config), "--block-size", str(BLOCK))


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Engine, Engine]]:
    store = tmp_path_factory.mktemp("kv-store")
    with vllms(tiny_model, VllmSpec(connector_flags(store)),
               VllmSpec(connector_flags(store))) as (prefill, decode):
        yield prefill, decode


@pytest.fixture(scope="module")
def gateway(engines: tuple[Engine, Engine], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    prefill, decode = engines
    config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "replicas": [
        {"url": prefill.url, "engine": "vllm", "name": "prefill", "role": "prefill"},
        {"url": decode.url, "engine": "vllm", "name": "decode", "role": "decode"}]}],
        "health": {"interval": 0.5, "timeout": 3.0}}
    with gateway_server(tmp_path_factory.mktemp("gw"), config) as (url, _):
        yield url


def prompt(k: int) -> str:
    """Prompts that differ in their first block: no engine's own prefix cache holds one for
    another (a hit there is a local one, and the connector loads nothing)."""
    words = "prefill decode cache block engine stream token gateway".split()
    return f"request {k}: " + " ".join(words[(k * 7 + i) % len(words)] for i in range(60 + k))


def events(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.split("\n")
            if line.startswith("data: ") and line[6:] != "[DONE]"]


def tokens_of(text: str) -> tuple[list[int], str]:
    """A stream's token ids and text, in order (vLLM may put two tokens in one event when
    its client lags: the events themselves differ from run to run)."""
    choices = [c for e in events(text) for c in e.get("choices", [])]
    return ([i for c in choices for i in c.get("token_ids") or []],
            "".join(c.get("text") or "" for c in choices))


def test_greedy_output_through_the_pd_pair_equals_an_aggregated_engines(
        engines: tuple[Engine, Engine], gateway: str) -> None:
    prefill, decode = engines
    aggregated = prefill  # serving the same requests whole, after the pair did
    before = decode.metric(LOADED)
    expected = 0  # tokens the decode engine should load, request by request
    for k in range(3):
        body = {"model": "tiny", "prompt": prompt(k), "max_tokens": 16, "temperature": 0,
                "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        via = httpx.post(gateway + "/v1/completions", json=body, timeout=60)
        assert via.status_code == 200, via.text
        assert via.headers["x-gateway-replica"] == "decode"
        alone = httpx.post(aggregated.url + "/v1/completions", json=body, timeout=60)
        assert tokens_of(via.text) == tokens_of(alone.text)
        assert events(via.text)[-1]["usage"] == events(alone.text)[-1]["usage"]  # prompt once
        expected += loaded(events(alone.text)[-1]["usage"]["prompt_tokens"])
    # Not streamed, chat, and a TGI client (translated) too.
    whole = {"model": "tiny", "prompt": prompt(9), "max_tokens": 12, "temperature": 0}
    via = httpx.post(gateway + "/v1/completions", json=whole, timeout=60).json()
    alone = httpx.post(aggregated.url + "/v1/completions", json=whole, timeout=60).json()
    assert via["choices"][0]["text"] == alone["choices"][0]["text"]
    assert via["usage"] == alone["usage"]
    expected += loaded(alone["usage"]["prompt_tokens"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt(10)}],
            "max_tokens": 10, "temperature": 0}
    via = httpx.post(gateway + "/v1/chat/completions", json=chat, timeout=60).json()
    alone = httpx.post(aggregated.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert via["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    expected += loaded(alone["usage"]["prompt_tokens"])
    tgi = httpx.post(gateway + "/generate", timeout=60, json={
        "inputs": prompt(11), "parameters": {"max_new_tokens": 10, "details": True}})
    reference = httpx.post(aggregated.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt(11), "max_tokens": 10, "temperature": 0,
        "return_token_ids": True})
    assert [t["id"] for t in tgi.json()["details"]["tokens"]] == \
        reference.json()["choices"][0]["token_ids"]
    expected += loaded(reference.json()["usage"]["prompt_tokens"])
    # Each of the 6 answers loaded its prompt's KV from the store the prefill engine wrote.
    assert expected >= 4 * BLOCK  # most of these prompts are loaded, not recomputed
    wait_until(lambda: decode.metric(LOADED) - before == expected, 10,
               lambda: f"decode engine loaded {decode.metric(LOADED) - before} of {expected}")
    assert by_label(gateway, "llm_gateway_prefills_total", "outcome").get("ok") == 6
    wait_until(lambda: metric_sum(gateway, "llm_gateway_replica_outstanding_tokens") == 0, 10,
               "every lease returned")


def test_a_killed_prefill_engine_costs_no_request(engines: tuple[Engine, Engine],
                                                  gateway: str) -> None:
    """Last in the module: its prefill engine stays down."""
    prefill, decode = engines
    aggregated = decode  # serving the same requests whole, afterwards

    def ask(k: int) -> tuple[int, str]:
        r = httpx.post(gateway + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt(20 + k), "max_tokens": 24, "temperature": 0})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    def prefilled() -> float:
        return by_label(gateway, "llm_gateway_prefills_total", "outcome").get("ok", 0)

    done = prefilled()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        before = [pool.submit(ask, k) for k in range(4)]
        wait_until(lambda: prefilled() >= done + 2, 60, "some prefills of this run done")
        prefill.kill()
        after = [pool.submit(ask, k) for k in range(4, 8)]
        answers = [f.result() for f in before + after]
    assert [status for status, _ in answers] == [200] * 8, answers
    # Greedy: each answer is the aggregated engine's, however it was prefilled.
    for k, (_, text) in enumerate(answers):
        alone = httpx.post(aggregated.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt(20 + k), "max_tokens": 24, "temperature": 0})
        assert text == alone.json()["choices"][0]["text"]
    skipped = by_label(gateway, "llm_gateway_prefill_skipped_total", "reason")
    assert skipped.get("failed", 0) + skipped.get("unavailable", 0) >= 1
    wait_until(lambda: metric_sum(gateway, "llm_gateway_replica_outstanding_tokens") == 0, 10,
               "every lease returned")
