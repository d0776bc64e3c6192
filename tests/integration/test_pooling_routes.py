"""vLLM's routes that generate nothing, through the gateway to simulated vLLM replicas: an
embedding engine (--runner pooling) and a generate engine. Answers are the engine's; the
window is checked on the texts the engine tokenizes; bad input is a 4xx in OpenAI's shape;
the ledger ends at zero."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from gateway.sim.model_dir import builtin_model_dir
from scrape import samples
from support import gateway_server, sim

WINDOW = 64
IDS = ("id", "created")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tokenizer = str(builtin_model_dir())
    with sim("vllm", "embed", WINDOW, "--runner", "pooling") as embed, \
            sim("vllm", "gen", WINDOW) as gen, sim("tgi", "tgi-model", WINDOW) as tgi:
        config = {"models": [
            {"name": "embed", "tokenizer": tokenizer, "replicas": [{"url": embed}]},
            {"name": "gen", "tokenizer": tokenizer, "replicas": [{"url": gen}]},
            {"name": "tgi-model", "replicas": [{"url": tgi, "engine": "tgi"}]}],
                  "default_model": "tgi-model"}  # TGI clients name no model
        with gateway_server(tmp_path_factory.mktemp("gw"), config) as (gateway, _):
            yield {"gateway": gateway, "embed": embed, "gen": gen, "tgi": tgi}


def _both(fleet: dict[str, str], engine: str, path: str, body: dict[str, Any]
          ) -> tuple[httpx.Response, httpx.Response]:
    through = httpx.post(fleet["gateway"] + path, json=body, timeout=30)
    direct = httpx.post(fleet[engine] + path, json=body, timeout=30)
    return through, direct


def _same(through: httpx.Response, direct: httpx.Response) -> None:
    assert through.status_code == direct.status_code == 200, through.text
    a, b = through.json(), direct.json()
    for key in IDS:
        a.pop(key, None), b.pop(key, None)
    assert a == b


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"model": "embed", "input": "the quick brown fox"}),
    ("/v1/embeddings", {"model": "embed", "input": ["one", "two", "three"]}),
    ("/v1/embeddings", {"model": "embed", "input": [1, 2, 3]}),
    ("/pooling", {"model": "embed", "input": "pool me"}),
    ("/classify", {"model": "embed", "input": ["good", "bad"]}),
    ("/score", {"model": "embed", "text_1": "query", "text_2": ["a doc", "another"]}),
    ("/v1/score", {"model": "embed", "text_1": ["q1", "q2"], "text_2": ["d1", "d2"]}),
    ("/rerank", {"model": "embed", "query": "q", "documents": ["x", "y", "z"], "top_n": 2}),
    ("/v1/rerank", {"model": "embed", "query": "q", "documents": [{"text": "x"}, "y"]}),
])
def test_pooling_routes_answer_as_the_engine(fleet: dict[str, str], path: str,
                                             body: dict[str, Any]) -> None:
    through, direct = _both(fleet, "embed", path, body)
    _same(through, direct)
    assert through.headers["x-gateway-replica"]


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"model": "gen", "prompt": "hello world"}),
    ("/tokenize", {"model": "gen", "messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"model": "gen", "tokens": [5, 6, 7]}),
])
def test_tokenize_and_detokenize_answer_as_the_engine(fleet: dict[str, str], path: str,
                                                      body: dict[str, Any]) -> None:
    _same(*_both(fleet, "gen", path, body))


def test_tgi_tokenize_goes_to_a_tgi_engine_and_errs_in_tgi_shape(fleet: dict[str, str]) -> None:
    """TGI's /tokenize (an `inputs` body) is TGI's: answered by a TGI engine as it is, and
    refused in TGI's shape."""
    body = {"inputs": "hello world", "parameters": {}}
    through, direct = _both(fleet, "tgi", "/tokenize", body)
    assert through.status_code == direct.status_code == 200, through.text
    assert through.json() == direct.json() and isinstance(through.json(), list)
    for bad in ({"inputs": 5}, {"inputs": None}):
        r = httpx.post(fleet["gateway"] + "/tokenize", json=bad)
        assert r.status_code == 422, r.text
        assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"


def test_input_past_the_window_is_refused_before_the_engine(fleet: dict[str, str]) -> None:
    long = " ".join(["word"] * (WINDOW * 2))
    for path, body in (("/v1/embeddings", {"model": "embed", "input": ["short", long]}),
                       ("/rerank", {"model": "embed", "query": long, "documents": ["d"]}),
                       ("/score", {"model": "embed", "text_1": "q", "text_2": long})):
        r = httpx.post(fleet["gateway"] + path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and f"is {WINDOW} tokens" in error["message"]
        assert "x-gateway-replica" not in r.headers  # refused at admission
    # tokenize runs no model: the engine answers the count and its window
    r = httpx.post(fleet["gateway"] + "/tokenize", json={"model": "gen", "prompt": long})
    assert r.status_code == 200 and r.json()["count"] > WINDOW


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"model": "embed"}, "input"),
    ("/v1/embeddings", {"model": "embed", "input": 5}, "input"),
    ("/v1/embeddings", {"model": "embed", "input": []}, "input"),
    ("/score", {"model": "embed", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"model": "embed", "text_1": "a"}, "text_2"),
    ("/rerank", {"model": "embed", "query": "q", "documents": []}, "documents"),
    ("/rerank", {"model": "embed", "query": 3, "documents": ["x"]}, "query"),
    ("/rerank", {"model": "embed", "query": "q", "documents": [7]}, "documents"),
    ("/detokenize", {"model": "gen", "tokens": ["a"]}, "tokens"),
    ("/tokenize", {"model": "gen"}, "prompt"),
    ("/classify", {"model": "nope", "input": "x"}, "model"),
])
def test_bad_input_is_a_4xx_naming_the_field(fleet: dict[str, str], path: str,
                                             body: dict[str, Any], param: str) -> None:
    r = httpx.post(fleet["gateway"] + path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == param


def test_garbage_bodies_and_a_route_the_engine_lacks(fleet: dict[str, str]) -> None:
    for raw in (b"", b"{", b"[1]", b"\xff\xfe"):
        r = httpx.post(fleet["gateway"] + "/v1/embeddings", content=raw)
        assert r.status_code == 400 and "error" in r.json()
    # The generate engine has no /v1/embeddings (real vLLM answers 404 too): its 404 in
    # OpenAI's shape.
    r = httpx.post(fleet["gateway"] + "/v1/embeddings", json={"model": "gen", "input": "x"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_ledger_ends_at_zero_and_input_tokens_are_metered(fleet: dict[str, str]) -> None:
    r = httpx.post(fleet["gateway"] + "/v1/embeddings", json={"model": "embed", "input": "abc"})
    assert r.status_code == 200
    metrics = samples(fleet["gateway"])
    load = [v for n, _, v in metrics if n in ("llm_gateway_replica_outstanding_tokens",
                                              "llm_gateway_replica_in_flight_requests")]
    assert load and not any(load)
    prompt = sum(v for n, l, v in metrics
                 if n == "llm_gateway_prompt_tokens_total" and l["model"] == "embed")
    assert prompt >= r.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("method,path,status,shape", [
    ("POST", "/v1/foo", 404, "openai"), ("GET", "/v1/files", 404, "openai"),
    ("POST", "/v2/rerank", 404, "openai"), ("POST", "/chat_tokenize", 404, "tgi"),
    ("DELETE", "/nowhere", 404, "tgi"), ("GET", "/v1/embeddings", 405, "openai"),
    ("GET", "/generate", 405, "tgi"),
])
def test_a_route_the_gateway_does_not_serve_is_refused_in_its_clients_shape(
        fleet: dict[str, str], method: str, path: str, status: int, shape: str) -> None:
    r = httpx.request(method, fleet["gateway"] + path, json={"model": "gen", "input": "x"})
    assert r.status_code == status, r.text
    body = r.json()
    if shape == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert path in body["error"]["message"]
    else:
        assert set(body) == {"error", "error_type"} and path in body["error"]
    assert "x-gateway-replica" not in r.headers  # never passed on to an engine
