"""Shadow traffic and output agreement, over real processes: a gateway in front of simulated
replicas, driven by the real openai and text-generation clients. Every primary request has
its twin on each shadow pool (the engines' own counters prove it), the client only sees the
primary, both pools' ledgers end at 0, a shadow pool that is down or slow fails no primary
request, and agreement is 100% between engines with the same text model and 0% against one
that generates different text (``--text-seed``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from text_generation import Client as TGIClient

from gateway.canary.agreement import TextCollector, is_greedy
from gateway.protocol.errors import Api
from gateway.protocol.request import GenerationRequest
from scrape import by_label, metric_sum
from support import ROOT, free_port, gateway_server, sim, wait_until

MODEL = "sim-model"
TOKEN = "shadow-admin-token"
PACED = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "2")
AUTH = {"authorization": f"Bearer {TOKEN}"}


def engine_successes(url: str) -> float:
    """Requests the simulated vLLM engine finished, from its own /metrics."""
    return metric_sum(url, "vllm:request_success_total")


def series(url: str, name: str, **labels: str) -> float:
    """Sum of a gateway metric's samples whose labels include ``labels``."""
    return metric_sum(url, name, **labels)


def ledger(url: str) -> dict[str, float]:
    """Outstanding tokens + in-flight requests per replica, as the gateway's ledger holds them."""
    out: dict[str, float] = {}
    for name in ("llm_gateway_replica_outstanding_tokens", "llm_gateway_replica_in_flight_requests"):
        for replica, value in by_label(url, name, "replica").items():
            out[replica] = out.get(replica, 0.0) + value
    return out


def report(url: str) -> dict:
    response = httpx.get(f"{url}/admin/canary/{MODEL}/disagreements", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def _ended(pool: dict) -> int:
    """Primaries whose copy to the pool is accounted for: compared, dropped or skipped."""
    return (pool["compared"] + sum(pool["dropped"].values()) + sum(pool["skipped"].values())
            if pool else 0)


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[dict[str, str]]:
    tok = ("--tokenizer", str(model_dir))
    with sim("vllm", MODEL, 4096, *tok, *PACED) as stable, \
            sim("vllm", MODEL, 4096, *tok, *PACED) as same, \
            sim("vllm", MODEL, 4096, *tok, *PACED, "--text-seed", "7") as other:
        yield {"stable": stable, "same": same, "other": other}


@pytest.fixture(scope="module")
def shadowed(engines, model_dir: Path, tmp_path_factory) -> Iterator[str]:
    """stable takes the traffic; `same` (same text) and `other` (--text-seed 7) shadow all of it."""
    config = {"models": [{"name": MODEL, "tokenizer": str(model_dir), "pools": [
        {"name": "stable", "replicas": [{"url": engines["stable"], "name": "stable-1"}]},
        {"name": "same", "shadow_of": "stable", "sample": 1.0,
         "replicas": [{"url": engines["same"], "name": "same-1"}]},
        {"name": "other", "shadow_of": "stable", "sample": 1.0,
         "replicas": [{"url": engines["other"], "name": "other-1"}]}]}],
        "health": {"interval": 0.5}, "admin_token": TOKEN}
    with gateway_server(tmp_path_factory.mktemp("shadow"), config) as (url, _):
        yield url


def _traffic(url: str) -> list[str]:
    """One request of each shape through real clients; returns the texts the client got."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    tgi = TGIClient(url, timeout=30)
    texts = []
    for i in range(3):
        prompt = f"Tell me about shadows, take {i}"
        texts.append(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0).choices[0].text)
        texts.append("".join(c.choices[0].text for c in oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)))
        messages = [{"role": "user", "content": prompt}]
        texts.append(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 temperature=0).choices[0].message.content)
        texts.append("".join(c.choices[0].delta.content or "" for c in
                             oai.chat.completions.create(model=MODEL, messages=messages,
                                                         max_tokens=8, stream=True)
                             if c.choices))
        texts.append(tgi.generate(prompt, max_new_tokens=8).generated_text)
        texts.append("".join(r.token.text for r in tgi.generate_stream(prompt, max_new_tokens=8)
                             if not r.token.special))
    return texts


PER_ROUND = 6  # requests _traffic sends per take
TAKES = 3


def test_every_primary_has_its_twin_and_agreement_is_measured(shadowed, engines) -> None:
    before = {name: engine_successes(url) for name, url in engines.items()}
    texts = _traffic(shadowed)
    sent = PER_ROUND * TAKES
    assert len(texts) == sent and all(texts)
    wait_until(lambda: all(_ended(report(shadowed)["pools"].get(p, {})) == sent
                           for p in ("same", "other")), 20, "every shadow copy ended")
    # The engines' own counters: every request reached stable and both shadows once.
    after = {name: engine_successes(url) for name, url in engines.items()}
    assert {name: after[name] - before[name] for name in engines} == {
        "stable": sent, "same": sent, "other": sent}
    pools = report(shadowed)["pools"]
    assert pools["same"]["compared"] == sent and pools["same"]["agreement"] == 1.0
    assert pools["same"]["greedy_compared"] == pools["same"]["greedy_agreed"] > 0
    assert pools["other"]["compared"] == sent and pools["other"]["agreed"] == 0
    assert pools["other"]["greedy_agreed"] == 0 and pools["other"]["greedy_compared"] > 0
    # The ring: newest first, the prompt as a hash, both outputs (truncated) to compare.
    ring = report(shadowed)["disagreements"]
    assert ring and all(d["shadow_pool"] == "other" and d["baseline_pool"] == "stable"
                        for d in ring)
    assert all(len(d["prompt_sha256"]) == 16 and d["primary"] != d["shadow"] for d in ring)
    assert ring[0]["primary"] in texts or any(ring[0]["primary"] in t for t in texts)
    # Metrics: the shadow copies are labelled, and counted on their own pools.
    assert series(shadowed, "llm_gateway_requests_total", pool="same", role="shadow",
                  status="2xx") >= sent
    assert series(shadowed, "llm_gateway_requests_total", role="shadow", pool="stable") == 0
    assert series(shadowed, "llm_gateway_shadow_pairs_total", pool="other",
                  result="disagreed") >= sent
    assert series(shadowed, "llm_gateway_shadow_pairs_total", pool="same",
                  result="disagreed") == 0
    wait_until(lambda: not any(ledger(shadowed).values()), timeout=10)
    assert set(ledger(shadowed)) == {"stable-1", "same-1", "other-1"}
    assert httpx.get(shadowed + "/admin/runtime", headers=AUTH).json()["shadow_in_flight"] == 0


def test_disagreements_endpoint_errors(shadowed) -> None:
    assert httpx.get(f"{shadowed}/admin/canary/{MODEL}/disagreements").status_code == 401
    assert httpx.get(f"{shadowed}/admin/canary/nope/disagreements",
                     headers=AUTH).status_code == 404


def test_shadow_pool_has_no_weight_and_can_be_forced(shadowed) -> None:
    put = httpx.put(f"{shadowed}/admin/models/{MODEL}/pools/same", json={"weight": 5},
                    headers=AUTH)
    assert put.status_code == 409 and "no primary traffic" in put.text
    pools = httpx.get(f"{shadowed}/admin/models", headers=AUTH).json()["models"][0]["pools"]
    assert {p["pool"]: (p["weight"], p["shadow_of"]) for p in pools} == {
        "stable": (100.0, None), "same": (0.0, "stable"), "other": (0.0, "stable")}
    forced = httpx.post(shadowed + "/v1/completions", headers={"x-gateway-pool": "other"},
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert forced.status_code == 200 and forced.headers["x-gateway-pool"] == "other"


def test_shadow_pool_down_or_slow_fails_no_primary_request(model_dir: Path, tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with sim("vllm", MODEL, 4096, *PACED) as stable, \
            sim("vllm", MODEL, 4096, "--profile", "paced", "--ttft-ms", "1500",
                "--itl-ms", "50") as slow, \
            sim("vllm", MODEL, 4096, *PACED, "--error-rate", "1.0") as failing:
        config = {"models": [{"name": MODEL, "pools": [
            {"name": "stable", "replicas": [{"url": stable, "name": "stable-1"}]},
            {"name": "down", "shadow_of": "stable", "sample": 1.0,
             "replicas": [{"url": dead, "name": "down-1"}]},
            # Answers every request with a 500: copies fail, but never eject it.
            {"name": "failing", "shadow_of": "stable", "sample": 1.0,
             "replicas": [{"url": failing, "name": "failing-1"}]},
            {"name": "slow", "shadow_of": "stable", "sample": 1.0,
             "replicas": [{"url": slow, "name": "slow-1"}]}]}],
            "health": {"interval": 0.5}, "admin_token": TOKEN,
            "outlier": {"consecutive_failures": 1},
            "canary": {"max_shadow_in_flight": 4}}
        with gateway_server(tmp_path, config) as (url, _):
            before = engine_successes(stable)
            oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            for i in range(12):
                stream = i % 2 == 0
                answer = oai.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=4,
                                                stream=stream)
                text = ("".join(c.choices[0].text for c in answer) if stream
                        else answer.choices[0].text)
                assert text
            assert engine_successes(stable) - before == 12
            # The primary's figures: every request 2xx, none retried, rejected or ejected.
            assert series(url, "llm_gateway_requests_total", role="primary", status="2xx") == 12
            assert series(url, "llm_gateway_requests_total", role="primary", status="5xx") == 0
            assert series(url, "llm_gateway_retries_total") == 0
            assert series(url, "llm_gateway_rejections_total") == 0
            replicas = httpx.get(url + "/admin/replicas", headers=AUTH).json()["replicas"]
            states = {r["name"]: r["state"] for r in replicas}
            assert states["stable-1"] == "healthy"
            # Shadow failures eject nothing (outlier.consecutive_failures is 1 here) and are
            # the shadow's own: 5xx under role="shadow", never retried.
            assert states["failing-1"] == "healthy"
            assert series(url, "llm_gateway_requests_total", pool="failing", role="shadow",
                          status="5xx") > 0
            # The shadows: the slow pool held the in-flight limit, so copies were skipped.
            assert series(url, "llm_gateway_shadow_skipped_total", reason="in_flight_limit") > 0
            wait_until(lambda: not any(ledger(url).values()), timeout=30)
            runtime = httpx.get(url + "/admin/runtime", headers=AUTH).json()
            assert runtime["shadow_in_flight"] == 0 and runtime["active_requests"] == 0
            pools = report(url)["pools"]
            # Every primary offered a copy is in the view: compared, dropped or skipped.
            assert {name: _ended(pool) for name, pool in pools.items()} == {
                "down": 12, "failing": 12, "slow": 12}
            assert pools["slow"]["skipped"]["in_flight_limit"] == series(
                url, "llm_gateway_shadow_skipped_total", pool="slow", reason="in_flight_limit")
            # Down: a copy sent before the health check saw it fails (dropped); after, the
            # pool has no available replica and the copy is not sent (skipped, rejected).
            down = pools["down"]
            assert down["compared"] == 0 and (down["dropped"].get("shadow_failed", 0)
                                              + down["skipped"].get("rejected", 0)) == 12, down
            assert pools["failing"]["compared"] == 0
            assert pools["failing"]["dropped"]["shadow_failed"] > 0


def test_text_collector_reads_every_shape() -> None:
    openai_stream = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
                     b'\n\ndata: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n'
                     b'data: {"choices":[{"index":0,"del')
    collector = TextCollector(Api.OPENAI, 100)
    collector.feed(openai_stream)
    collector.feed(b'ta":{"content":" b"}}]}\n\ndata: [DONE]\n\n')
    assert collector.text == " a b" and not collector.failed
    tgi = TextCollector(Api.TGI, 100)
    tgi.feed(b'data:{"token":{"text":" x","special":false},"generated_text":null}\n\n'
             b'data:{"token":{"text":"</s>","special":true},"generated_text":" x"}\n\n')
    assert tgi.text == " x"
    broken = TextCollector(Api.OPENAI, 100)
    broken.feed(b'data: {"error": {"message": "boom"}}\n\n')
    assert broken.failed
    long = TextCollector(Api.OPENAI, 3)
    long.body(b'{"choices":[{"index":0,"text":"four"}]}')
    assert long.too_long and long.text == ""


def _req(api: Api, body: dict) -> GenerationRequest:
    return GenerationRequest(api, "/", body, b"", MODEL, False, 1)


def test_greedy_rule() -> None:
    assert is_greedy(_req(Api.OPENAI, {"temperature": 0}))
    assert not is_greedy(_req(Api.OPENAI, {}))
    assert is_greedy(_req(Api.TGI, {"parameters": {"max_new_tokens": 3}}))
    assert not is_greedy(_req(Api.TGI, {"parameters": {"do_sample": True}}))
    assert not is_greedy(_req(Api.TGI, {"parameters": {"temperature": 0.5}}))


def test_shadow_copies_leave_session_affinity_alone(engines, tmp_path) -> None:
    """The session's requests keep their stable replica: the balancer never records a copy's
    shadow replica as the session's last one."""
    config = {"models": [{"name": MODEL, "pools": [
        {"name": "stable", "replicas": [{"url": engines["stable"], "name": "stable-a"},
                                        {"url": engines["same"], "name": "stable-b"}]},
        {"name": "copy", "shadow_of": "stable", "sample": 1.0,
         "replicas": [{"url": engines["other"], "name": "copy-1"}]}]}],
        "health": {"interval": 0.5}, "admin_token": TOKEN}
    with gateway_server(tmp_path, config) as (url, _), httpx.Client(timeout=10) as client:
        for s, session in enumerate(("s-1", "s-2")):
            served = set()
            for i in range(10):
                response = client.post(url + "/v1/completions", headers={"x-session-id": session},
                                       json={"model": MODEL, "prompt": f"{i} {session} question",
                                             "max_tokens": 2})
                assert response.status_code == 200
                served.add(response.headers["x-gateway-replica"])
                pairs = 10 * s + i + 1  # the copy has been placed (and compared) by now
                wait_until(lambda: report(url)["pools"].get("copy", {}).get("compared") == pairs,
                           20, f"pair {pairs} compared")
            assert len(served) == 1, (session, served)
        wait_until(lambda: report(url)["pools"].get("copy", {}).get("compared") == 20, 20,
                   "all 20 pairs compared")


def test_streamed_pairs_are_compared_when_the_primary_ends_at_once(tmp_path) -> None:
    """A primary stream that arrives whole, in one write (a fast real engine, a short answer),
    ends before the gateway starts reading it to the client: its pair is still compared.
    (Before the fix the primary's text reader was attached after the stream had ended and
    never heard the end: the pair vanished, neither compared nor dropped.)"""
    from segmented_engine import serving

    config_pools = lambda engine: [  # noqa: E731
        {"name": "stable", "replicas": [{"url": engine, "name": "stable-1"}]},
        {"name": "copy", "shadow_of": "stable", "sample": 1.0,
         "replicas": [{"url": engine, "name": "copy-1"}]}]
    requests = 20
    with serving() as engine:
        config = {"models": [{"name": MODEL, "pools": config_pools(engine)}],
                  "health": {"interval": 0.5}, "admin_token": TOKEN}
        with gateway_server(tmp_path, config) as (url, _), httpx.Client(timeout=10) as client:
            for i in range(requests):
                body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 16, "stream": True,
                        "temperature": 0, "segmentation": {
                            "recording": ("vllm-completions-usage" if i % 2
                                          else "vllm-completions-no-usage"),
                            "cuts": [], "gaps": []}}
                answer = client.post(url + "/v1/completions", json=body)
                assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
            wait_until(lambda: _ended(report(url)["pools"].get("copy", {})) == requests,
                       timeout=10)
            pool = report(url)["pools"]["copy"]
            assert pool["compared"] == requests and pool["agreement"] == 1.0, pool
            wait_until(lambda: not any(ledger(url).values()), timeout=10)


def test_copies_without_a_free_shadow_slot_are_listed_as_skipped(tmp_path) -> None:
    """The shadow pool's one replica takes one request at a time and answers slowly: while
    it serves one copy, the next primaries' copies find no free slot and are skipped. The
    disagreements view and the canary report list them beside the compared and dropped pairs,
    and the three add up to the primaries offered a copy."""
    primaries = 6
    with sim("vllm", MODEL, 4096, *PACED) as stable, \
            sim("vllm", MODEL, 4096, "--profile", "paced", "--ttft-ms", "3000",
                "--itl-ms", "10") as slow:
        config = {"models": [{"name": MODEL, "pools": [
            {"name": "stable", "replicas": [{"url": stable, "name": "stable-1"}]},
            {"name": "tight", "shadow_of": "stable", "sample": 1.0,
             "replicas": [{"url": slow, "name": "tight-1"}]}]}],
            "health": {"interval": 0.5}, "admin_token": TOKEN,
            "backpressure": {"max_in_flight_per_replica": 1}}
        with gateway_server(tmp_path, config) as (url, _), httpx.Client(timeout=30) as client:
            for i in range(primaries):  # one after another: stable-1 always has its slot
                body = {"model": MODEL, "prompt": f"skip me {i}", "max_tokens": 4,
                        "temperature": 0}
                assert client.post(url + "/v1/completions", json=body).status_code == 200
            wait_until(lambda: _ended(report(url)["pools"].get("tight", {})) == primaries, 20,
                       "every copy compared, dropped or skipped")
            pool = report(url)["pools"]["tight"]
            skipped = pool["skipped"].get("no_slot", 0)
            assert skipped >= primaries - 2 and pool["compared"] >= 1, pool
            assert pool["compared"] + sum(pool["dropped"].values()) + skipped == primaries
            # The same figures in /metrics: a skipped copy is not also a dropped pair.
            assert series(url, "llm_gateway_shadow_skipped_total", pool="tight",
                          reason="no_slot") == skipped
            assert series(url, "llm_gateway_shadow_pairs_dropped_total", pool="tight") == sum(
                pool["dropped"].values())
            # The canary report: its pairs add up the same way, and its table says so.
            done = _canary_report(url, "--json")
            pairs = next(m["pairs"] for m in json.loads(done.stdout)["metrics"]
                         if m["metric"] == "agreement")
            assert pairs["skipped"] == skipped, pairs
            assert (pairs["greedy_compared"] + pairs["not_greedy"] + pairs["dropped"]
                    + pairs["skipped"]) == primaries
            table = _canary_report(url).stdout
            assert (f"{pairs['greedy_compared']} compared, 0 not greedy (not judged), "
                    f"{pairs['dropped']} dropped, {skipped} skipped") in table, table


def _canary_report(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "canary", "report", "--model", MODEL,
                           "--canary", "tight", "--gateway", url, "--admin-token", TOKEN, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
