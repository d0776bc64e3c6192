"""Hostile input on every endpoint: always a clear answer in the protocol's own error shape,
never a 500 or a stack trace, and nothing left behind (load, queue, engine sequences)."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import gateway_server, settle, sim

MODEL = "sim-model"
TOKEN = "fuzz-admin"
OPENAI_PATHS = ["/v1/completions", "/v1/chat/completions"]
TGI_PATHS = ["/generate", "/generate_stream", "/"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
          "stream_options", "include_usage", "temperature", "n", "stop", "user", "role",
          "content", "inputs", "parameters", "max_new_tokens", "details", "tools", "logprobs",
          "echo", "best_of", "seed", "top_p", "decoder_input_details", "type", "text", "input",
          "text_1", "text_2", "query", "documents", "top_n", "tokens", "previous_response_id",
          "max_output_tokens", "store", "instructions", "adapter_id"]
# Routes that generate nothing, and the Responses API (OpenAI's error shape).
MORE_OPENAI_PATHS = ["/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                     "/v1/rerank", "/tokenize", "/detokenize", "/v1/responses"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=40), st.sampled_from([MODEL, "user", "hi"]))
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5)),
    max_leaves=12)
# Mostly well-formed requests with one thing wrong, plus free-form JSON and raw bytes.
openai_like = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "nope", ""]) | values},
    optional={"prompt": st.text(max_size=50) | values,
              "messages": st.lists(st.fixed_dictionaries(
                  {"role": st.sampled_from(["user", "system", "assistant", "bogus"]) | values,
                   "content": st.text(max_size=50) | values}), max_size=3) | values,
              "max_tokens": st.integers(min_value=-5, max_value=10**9) | values,
              "stream": st.booleans() | values,
              "stream_options": values})
tgi_like = st.fixed_dictionaries(
    {"inputs": st.text(max_size=50) | values},
    optional={"parameters": st.fixed_dictionaries(
        {}, optional={"max_new_tokens": st.integers(min_value=-5, max_value=10**9) | values,
                      "details": st.booleans() | values, "stop": values}) | values,
              "stream": st.booleans() | values})


def dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # stdlib: integers beyond 64 bits too


bodies = st.one_of(
    openai_like.map(dumps), tgi_like.map(dumps), values.map(dumps),
    st.binary(max_size=200), st.just(b"[" * 200 + b"]" * 200), st.just(b'{"a":' * 100))
pooling_like = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "nope"]) | values},
    optional={name: st.text(max_size=30) | st.lists(st.text(max_size=10), max_size=3) | values
              for name in ("input", "text_1", "text_2", "query", "documents", "tokens",
                           "prompt", "previous_response_id", "max_output_tokens", "stream")})


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with sim("vllm", MODEL, 512, "--profile", "instant") as vllm, \
            sim("tgi", MODEL, 512, "--profile", "instant") as tgi:
        config = {"models": [{"name": MODEL, "default_output_tokens": 16, "replicas": [
            {"url": vllm, "engine": "vllm", "name": "vllm"},
            {"url": tgi, "engine": "tgi", "name": "tgi"}]}], "admin_token": TOKEN}
        with gateway_server(tmp_path_factory.mktemp("fuzz"), config) as (url, _):
            yield {"gw": url, "vllm": vllm, "tgi": tgi}


def check_answer(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.content[:300])
    assert b"Traceback" not in response.content
    if response.status_code < 400:
        return
    error = orjson.loads(response.content)
    if path in OPENAI_PATHS or path in MORE_OPENAI_PATHS:
        if path == "/tokenize" and isinstance(error.get("error"), str):  # TGI's /tokenize
            assert isinstance(error["error_type"], str)
            return
        assert isinstance(error["error"]["message"], str) and error["error"]["message"]
        assert "type" in error["error"] and "code" in error["error"]
    elif path in TGI_PATHS:
        assert isinstance(error["error"], str) and isinstance(error["error_type"], str)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(OPENAI_PATHS + TGI_PATHS), body=bodies,
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_generation_endpoints_never_fail_on_bad_input(gw, path: str, body: bytes,
                                                      content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(gw["gw"] + path, content=body, headers=headers, timeout=30)
    check_answer(path, response)


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(MORE_OPENAI_PATHS), body=pooling_like.map(dumps) | bodies)
def test_pooling_tokenize_and_responses_routes_never_fail_on_bad_input(gw, path: str,
                                                                       body: bytes) -> None:
    response = httpx.post(gw["gw"] + path, content=body, timeout=30)
    check_answer(path, response)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/models", "/info", "/health", "/ready", "/metrics",
                             "/admin/replicas", "/admin/runtime", "/admin/replicas/vllm/drain",
                             "/admin/replicas/x%00y", "/v1/completions", "/nope", "/generate",
                             "/admin/models", "/admin/models/x/pools/nope",
                             "/admin/canary/x%00y/disagreements", "/admin/canary/x%00y",
                             "/admin/canary/sim-model?window=-1&canary=%00",
                             "/admin/canary/sim-model?window=1e400",
                             "/admin/canary/sim-model?baseline=default&canary=default",
                             "/v1/responses/x%00y", "/v1/responses/resp_1/cancel",
                             "/v1/responses/" + "r" * 3000]),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
       auth=st.sampled_from(["", "Bearer " + TOKEN, "Bearer x", "Basic abc", "Bearer"]),
       body=st.binary(max_size=64))
def test_other_endpoints_never_fail(gw, path: str, method: str, auth: str, body: bytes) -> None:
    if path.endswith("/drain") and auth.endswith(TOKEN):
        path = "/admin/replicas/nope/drain"  # keep the fleet intact for the other tests
    if method == "DELETE" and auth.endswith(TOKEN) and path.startswith("/admin/replicas/"):
        path = "/admin/replicas/nope"
    headers = {"authorization": auth} if auth else {}
    response = httpx.request(method, gw["gw"] + path, content=body, headers=headers, timeout=30)
    assert response.status_code < 500 or path == "/ready", response.content[:300]
    assert b"Traceback" not in response.content


def test_huge_headers_and_oversized_bodies_are_refused(gw) -> None:
    url = gw["gw"] + "/v1/completions"
    big = httpx.post(url, content=b"x" * (33 * 1024 * 1024))
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    tgi_big = httpx.post(gw["gw"] + "/generate", content=b"x" * (33 * 1024 * 1024))
    assert tgi_big.status_code == 413 and tgi_big.json()["error_type"] == "validation"
    try:
        huge = httpx.post(url, json={"model": MODEL, "prompt": "x"},
                          headers={"x-huge": "a" * (1 << 20)})
    except httpx.TransportError:
        return  # the server closed the connection on the header block: refused too
    assert 400 <= huge.status_code < 500, huge.status_code


def test_nothing_is_left_behind_after_the_fuzzing(gw) -> None:
    """Runs last in this module: every request above released what it took."""
    admin = {"authorization": f"Bearer {TOKEN}"}
    def now() -> tuple[list, dict, list]:
        return (httpx.get(gw["gw"] + "/admin/replicas", headers=admin).json()["replicas"],
                httpx.get(gw["gw"] + "/admin/runtime", headers=admin).json(),
                [httpx.get(gw[name] + "/sim/state").json() for name in ("vllm", "tgi")])

    def idle(seen: tuple[list, dict, list]) -> bool:
        fleet, runtime, engines = seen
        return (all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in fleet)
                and runtime["active_requests"] == 0
                and all(e["running"] == 0 and e["waiting"] == 0 for e in engines))

    fleet, runtime, engines = settle(now, idle, 5, every=0.1)
    assert idle((fleet, runtime, engines)), (fleet, runtime, engines)
    assert all(r["state"] == "healthy" for r in fleet)
