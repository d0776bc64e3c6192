"""The gateway under a real uvicorn, in front of simulated replicas, driven by real clients."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client as TGIClient
from text_generation.errors import ValidationError as TGIValidationError

from gateway.tokens import ModelTokenizer
from scrape import by_label
from support import free_port, gateway_server, settle, sim, wait_until

MODEL = "sim-model"
GATEWAY_WINDOW = 2048  # below the replicas' 4096: only the gateway can reject in between
PACED = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "2")


@contextlib.contextmanager
def gateway(tmp_path: Path, replicas: list[dict], ready_path: str = "/ready",
            **settings: object) -> Iterator[str]:
    config = {"models": [{"name": MODEL, "replicas": replicas, **settings.pop("model", {})}],
              "health": {"interval": 0.5, "timeout": 1.0}, **settings}
    with gateway_server(tmp_path, config, ready_path) as (url, _):
        yield url


# How the replicas write their streams: all the events that are ready in one write, or each
# event in a write of its own (as vLLM does: its usage chunk and [DONE] leave separately).
WRITES = {"batched": (), "per-event": ("--event-writes", "--event-gap-ms", "1")}


@pytest.fixture(scope="module", params=list(WRITES))
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          model_dir: Path) -> Iterator[dict[str, str]]:
    """Two vLLM replicas and one TGI replica behind one gateway with the model's tokenizer."""
    tmp = tmp_path_factory.mktemp("fleet")
    tok = ("--tokenizer", str(model_dir), *WRITES[request.param])
    with sim("vllm", MODEL, 4096, *tok, *PACED) as vllm_a, \
            sim("vllm", MODEL, 4096, *tok, *PACED) as vllm_b, \
            sim("tgi", MODEL, 4096, *tok, *PACED) as tgi:
        replicas = [{"url": vllm_a, "engine": "vllm", "name": "vllm-a"},
                    {"url": vllm_b, "engine": "vllm", "name": "vllm-b"},
                    {"url": tgi, "engine": "tgi", "name": "tgi-c"}]
        with gateway(tmp, replicas, model={"tokenizer": str(model_dir),
                                           "max_model_len": GATEWAY_WINDOW}) as url:
            yield {"gateway": url, "vllm-a": vllm_a, "vllm-b": vllm_b, "tgi-c": tgi}


@pytest.fixture()
def client(fleet: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["gateway"] + "/v1", api_key="unused", max_retries=0)


def outstanding(gateway_url: str) -> dict[str, float]:
    return by_label(gateway_url, "llm_gateway_replica_outstanding_tokens", "replica")


def settled(gateway_url: str, timeout: float = 5.0) -> dict[str, float]:
    """Outstanding tokens once in-flight requests have ended (bounded wait)."""
    return settle(lambda: outstanding(gateway_url), lambda values: not any(values.values()),
                  timeout)


# --- OpenAI API, real `openai` client ---

def test_chat_completion(client: openai.OpenAI, tokenizer: ModelTokenizer, fleet) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Write a short story about a cat."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                           max_tokens=12)
    reply = raw.parse()
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == tokenizer.count_chat(messages)
    assert reply.choices[0].message.content
    assert raw.headers["x-gateway-replica"] in {"vllm-a", "vllm-b", "tgi-c"}
    assert raw.headers["x-gateway-pool"] == "default"
    assert raw.headers["x-request-id"]


def test_completion_prompt_count_matches_engine(client: openai.OpenAI,
                                                tokenizer: ModelTokenizer) -> None:
    prompt = "The gateway routes each request to the replica with the least outstanding tokens."
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert reply.usage.prompt_tokens == tokenizer.count_text(prompt, add_special_tokens=True)
    assert reply.usage.completion_tokens == 5


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream(client: openai.OpenAI, include_usage: bool, fleet) -> None:
    kwargs = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True,
        **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage_chunks = [c for c in chunks if c.usage is not None]
    # The gateway asks engines for usage; the client sees it only when it asked too.
    assert len(usage_chunks) == (1 if include_usage else 0)
    if include_usage:
        assert usage_chunks[0].usage.completion_tokens == 8
    assert not any(settled(fleet["gateway"]).values())


def test_completion_stream_raw_bytes_end_with_done(fleet) -> None:
    with httpx.stream("POST", fleet["gateway"] + "/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        body = r.read()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 4}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 4}})])
def test_response_framing_headers_appear_once(fleet, path: str, body: dict) -> None:
    """The engine's own length/framing/date/server headers are not passed on next to ours
    (strict HTTP clients such as aiohttp reject a duplicate Content-Length)."""
    import http.client
    import json

    host, port = fleet["gateway"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    response.read()
    assert response.status == 200
    for name in ("content-length", "transfer-encoding", "date", "server", "x-request-id"):
        assert len(response.msg.get_all(name) or []) <= 1, (name, response.getheaders())
    assert (response.msg.get_all("content-length") or response.msg.get_all("transfer-encoding"))
    connection.close()


def test_context_overflow_is_400_with_code(client: openai.OpenAI,
                                           tokenizer: ModelTokenizer) -> None:
    prompt = "hello " * 1500
    prompt_tokens = tokenizer.count_text(prompt)
    fits = GATEWAY_WINDOW - prompt_tokens
    assert fits > 0
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=fits).usage.prompt_tokens == prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=fits + 1)
    assert err.value.status_code == 400
    assert err.value.code == "context_length_exceeded"
    assert err.value.type == "invalid_request_error"
    message = err.value.body["message"]
    assert str(GATEWAY_WINDOW) in message and str(prompt_tokens) in message and str(fits + 1) in message


def test_chat_overflow_boundary(client: openai.OpenAI, tokenizer: ModelTokenizer) -> None:
    messages = [{"role": "user", "content": "tell me about the gpu " * 100}]
    fits = GATEWAY_WINDOW - tokenizer.count_chat(messages)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=fits)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=fits + 1)
    assert err.value.code == "context_length_exceeded"


def test_unknown_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"


def test_models_list_reports_window(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == GATEWAY_WINDOW


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"model": "sim-model", "messages": 3}',
                                  b'{"model": "sim-model", "prompt": "x", "max_tokens": -1}'])
def test_bad_input_is_4xx_and_leaves_nothing(fleet, body: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(fleet["gateway"] + path, content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert not any(settled(fleet["gateway"]).values())


# --- TGI API, real `huggingface_hub` and `text-generation` clients ---

def test_huggingface_hub_text_generation(fleet, tokenizer: ModelTokenizer) -> None:
    hf = InferenceClient(base_url=fleet["gateway"])
    text = hf.text_generation("Tell me a story", max_new_tokens=6)
    assert isinstance(text, str) and text
    detailed = hf.text_generation("Tell me a story", max_new_tokens=6, details=True)
    assert detailed.details.generated_tokens == 6
    streamed = list(hf.text_generation("Tell me a story", max_new_tokens=6, stream=True,
                                       details=True))
    assert len(streamed) == 6 and streamed[-1].generated_text
    assert streamed[-1].details.generated_tokens == 6


def test_text_generation_client(fleet, tokenizer: ModelTokenizer) -> None:
    tgi = TGIClient(fleet["gateway"], timeout=30)
    response = tgi.generate("Hello world", max_new_tokens=5)
    assert response.details.generated_tokens == 5
    tokens = [e for e in tgi.generate_stream("Hello world", max_new_tokens=5)]
    assert len(tokens) == 5 and tokens[-1].generated_text is not None
    prompt = "hello " * 1500
    fits = GATEWAY_WINDOW - tokenizer.count_text(prompt)
    assert tgi.generate(prompt, max_new_tokens=fits).details.generated_tokens == fits
    with pytest.raises(TGIValidationError, match=r"must be <= 2048"):
        tgi.generate(prompt, max_new_tokens=fits + 1)


def test_tgi_requests_reach_every_replica(fleet) -> None:
    """vLLM replicas serve TGI clients through translation; a parameter only TGI honours
    (watermark) keeps the request on the TGI replica."""
    served = set()
    # Sequential requests find every replica idle: ties are broken at random, so 30 tries
    # (each replica missed with probability 3 x (2/3)^30 < 1e-4; 12 missed one 2% of runs).
    for _ in range(30):
        r = httpx.post(fleet["gateway"] + "/generate",
                       json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200
        served.add(r.headers["x-gateway-replica"])
    assert served == {"vllm-a", "vllm-b", "tgi-c"}
    for _ in range(4):
        r = httpx.post(fleet["gateway"] + "/generate",
                       json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "watermark": True}})
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "tgi-c"


def test_info_reports_default_model_limits(fleet) -> None:
    info = httpx.get(fleet["gateway"] + "/info").json()
    assert info["model_id"] == MODEL and info["max_total_tokens"] == GATEWAY_WINDOW


# --- Disconnects release everything, at the gateway and at the engine ---

def sim_state(url: str) -> dict:
    return httpx.get(url + "/sim/state").json()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_upstream_and_releases_ledger(tmp_path: Path, stream: bool) -> None:
    with sim("vllm", MODEL, 4096, "--profile", "paced", "--ttft-ms", "5", "--itl-ms", "50") as url:
        with gateway(tmp_path, [{"url": url, "engine": "vllm", "name": "slow"}]) as gw:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "stream": stream}
            with httpx.Client(timeout=10) as http:
                if stream:
                    with http.stream("POST", gw + "/v1/completions", json=body) as r:
                        chunks = r.iter_raw()  # keep a reference: dropping it disconnects
                        for _ in range(3):
                            next(chunks)
                        assert outstanding(gw)["slow"] > 0
                        assert sim_state(url)["running"] == 1
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        http.post(gw + "/v1/completions", json=body, timeout=0.5)
            settle(lambda: sim_state(url)["running"], lambda running: not running, 5)
            state = sim_state(url)
            assert state["running"] == 0 and state["aborted_total"] == 1
            assert settled(gw) == {"slow": 0.0}


# --- Windows discovered from each engine; engine failures in the client's shape ---

def test_windows_are_discovered_and_long_requests_go_where_they_fit(
        tmp_path: Path, model_dir: Path, tokenizer: ModelTokenizer) -> None:
    tok = ("--tokenizer", str(model_dir), "--profile", "instant")
    with sim("vllm", MODEL, 1024, *tok) as small, sim("llamacpp", MODEL, 2048, *tok) as large, \
            sim("sglang", MODEL, 1024, *tok) as small2:
        replicas = [{"url": small, "engine": "vllm", "name": "small"},
                    {"url": large, "engine": "llamacpp", "name": "large"},
                    {"url": small2, "engine": "sglang", "name": "small2"}]
        with gateway(tmp_path, replicas, model={"tokenizer": str(model_dir)}) as gw:
            client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
            # Discovered by the health checker's probes: the first can time out (1 s) on a
            # loaded machine, and the next, half a second on, finds it.
            wait_until(lambda: client.models.list().data[0].model_extra["max_model_len"] == 2048,
                       10, "the largest window listed")
            prompt = "hello " * 1200
            n = tokenizer.count_text(prompt)
            assert 1024 < n < 2048
            for _ in range(4):
                raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt,
                                                                  max_tokens=2048 - n)
                assert raw.headers["x-gateway-replica"] == "large"
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=2049 - n)
            assert err.value.code == "context_length_exceeded" and "2048" in err.value.message
            short = {r: 0 for r in ("small", "large", "small2")}
            # Idle replicas tie, broken at random: 30 requests leave one replica out with a
            # chance of 3 x (2/3)^30, 1e-5 (12 did in a loaded fresh-clone run: 2%).
            for _ in range(30):
                raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi",
                                                                  max_tokens=4)
                short[raw.headers["x-gateway-replica"]] += 1
            assert all(short.values()), short  # short ones spread over every engine


def test_engine_context_error_passes_through_in_client_shape_without_tokenizer(
        tmp_path: Path) -> None:
    with sim("llamacpp", MODEL, 256, "--profile", "instant") as url:
        with gateway(tmp_path, [{"url": url, "engine": "llamacpp"}]) as gw:
            client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=MODEL, prompt="hello " * 400, max_tokens=4)
            assert err.value.code == "context_length_exceeded"
            assert "exceeds the available context size" in err.value.message
            # A TGI client, translated to llama.cpp: its refusal in TGI's shape
            tgi = httpx.post(gw + "/generate", json={"inputs": "hello " * 400})
            assert tgi.status_code == 400 and tgi.json()["error_type"] == "validation"
            assert "exceeds the available context size" in tgi.json()["error"]


def test_engine_failures_reach_clients_as_well_formed_errors(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 4096, "--profile", "paced", "--ttft-ms", "1", "--itl-ms", "5",
             "--drop-after", "3") as dropper, \
            sim("tgi", MODEL, 4096, "--profile", "paced", "--ttft-ms", "1", "--itl-ms", "5",
                "--drop-after", "3") as tgi_dropper:
        replicas = [{"url": dropper, "engine": "vllm", "name": "dropper"},
                    {"url": tgi_dropper, "engine": "tgi", "name": "tgi-dropper"}]
        with gateway(tmp_path, replicas) as gw:
            with httpx.stream("POST", gw + "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 50, "stream": True}) as r:
                body = r.read()
            events = [e for e in body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            assert events[-2].startswith(b'data: {"error": ') or events[-2].startswith(b'data: {"error":')
            client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.APIError):
                for _ in client.completions.create(model=MODEL, prompt="x", max_tokens=50,
                                                   stream=True):
                    pass
            from text_generation import Client
            from text_generation.errors import UnknownError, GenerationError
            with pytest.raises((GenerationError, UnknownError)):
                for _ in Client(gw).generate_stream("x", max_new_tokens=50):
                    pass
            assert not any(settled(gw).values())


def test_unreachable_replica_is_a_502_then_marked_down(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = [{"url": dead, "engine": "vllm", "max_model_len": 4096}]
    with gateway(tmp_path, replicas, ready_path="/health") as gw:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        first = httpx.post(gw + "/v1/completions", json=body)
        assert first.status_code in (502, 503)
        assert first.json()["error"]["type"] == "server_error"
        settle(lambda: httpx.get(gw + "/ready").status_code, lambda status: status == 503, 5,
               every=0.1)
        r = httpx.post(gw + "/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"
        tgi = httpx.post(gw + "/generate", json={"inputs": "x"})  # translated, but none is up
        assert tgi.status_code == 503 and tgi.json()["error_type"] == "overloaded"


def test_stalled_stream_ends_with_timeout_error_event(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 4096, "--profile", "paced", "--ttft-ms", "1", "--itl-ms", "5",
             "--stall-after", "3") as staller:
        with gateway(tmp_path, [{"url": staller, "engine": "vllm", "name": "staller"}],
                     timeouts={"between_tokens": 0.5}) as gw:
            with httpx.stream("POST", gw + "/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True},
                    timeout=10) as r:
                events = [e for e in r.read().split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            error = events[-2]
            assert error.startswith(b'data: {"error":') and b"sent no token" in error
            assert len(events) == 3 + 2  # three tokens, the error, [DONE]
            settle(lambda: sim_state(staller)["running"], lambda running: not running, 5)
            assert sim_state(staller)["running"] == 0  # the upstream sequence was aborted
            assert not any(settled(gw).values())
