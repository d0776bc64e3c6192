"""Every client reaches every engine: the real TGI clients (``text_generation``, sync and
async, and ``huggingface_hub.InferenceClient``) through the gateway to vLLM, SGLang and
llama.cpp replicas with the assertions they pass against a TGI replica; the ``openai``
client to a TGI replica, also one too old for ``/v1/completions``; a pool mixing engines.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Iterator

import httpx
import openai
import orjson
import pytest
import text_generation
import text_generation.errors as tgi_errors
from huggingface_hub import InferenceClient

from gateway.tokens import ModelTokenizer
from support import gateway_server, settle, sim

MODEL = "sim-model"
WINDOW = 1024
PACED = ("--profile", "paced", "--ttft-ms", "2", "--itl-ms", "1")
PROMPT = "Tell me about the gateway"
ENGINES = ("tgi", "vllm", "sglang", "llamacpp")
# What each OpenAI engine cannot honour (refused with a 422 naming it, never dropped).
REFUSED = {"tgi": set(), "vllm": {"watermark"}, "sglang": {"watermark", "top_n_tokens",
                                                            "decoder_input_details"},
           "llamacpp": {"watermark", "stop", "best_of", "decoder_input_details"}}


def _config(replicas: list[dict], model_dir: Path, **extra: object) -> dict:
    return {"models": [{"name": MODEL, "tokenizer": str(model_dir), "max_model_len": WINDOW,
                        "replicas": replicas}],
            "health": {"interval": 0.5, "timeout": 1.0}, "admin_token": "t", **extra}


@pytest.fixture(scope="module", params=ENGINES)
def one_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               model_dir: Path) -> Iterator[tuple[str, str, str]]:
    """(engine, gateway URL, replica URL): one replica of the engine behind a gateway."""
    engine = request.param
    with sim(engine, MODEL, 4096, "--tokenizer", str(model_dir), *PACED) as replica:
        config = _config([{"url": replica, "engine": engine, "name": engine}], model_dir)
        with gateway_server(tmp_path_factory.mktemp(engine), config) as (url, _):
            yield engine, url, replica


def ledger(gateway: str) -> list[tuple[int, int]]:
    """Outstanding tokens and in-flight requests of every replica, once in-flight work ended."""
    def loads() -> list[tuple[int, int]]:
        # (30 s: a status poll; once, in a fresh-clone suite beside the real engines, the
        # default 5 s ran out on a starved machine.)
        replicas = httpx.get(gateway + "/admin/replicas", timeout=30,
                             headers={"authorization": "Bearer t"}).json()["replicas"]
        return [(r["outstanding_tokens"], r["in_flight"]) for r in replicas]

    return settle(loads, lambda now: not any(a or b for a, b in now), 5)


def _tokens_match_text(details: text_generation.types.Details, text: str) -> None:
    assert "".join(t.text for t in details.tokens if not t.special) == text
    for token in details.tokens:
        assert isinstance(token.id, int) and token.id >= 0 and token.logprob < 0


def test_text_generation_client(one_engine: tuple[str, str, str]) -> None:
    engine, url, _ = one_engine
    client = text_generation.Client(url, timeout=30)
    greedy = client.generate(PROMPT, max_new_tokens=6)
    d = greedy.details
    assert d.finish_reason == "length" and d.generated_tokens == 6 and len(d.tokens) == 6
    assert d.seed is None and d.prefill == []  # greedy: no seed; no decoder_input_details
    _tokens_match_text(d, greedy.generated_text)
    assert client.generate(PROMPT, max_new_tokens=6).generated_text == greedy.generated_text

    sampled = client.generate(PROMPT, max_new_tokens=6, do_sample=True, seed=11)
    assert sampled.details.seed == 11
    assert client.generate(PROMPT, max_new_tokens=6, do_sample=True, seed=11).generated_text \
        == sampled.generated_text
    drawn = client.generate(PROMPT, max_new_tokens=3, temperature=0.7)  # TGI draws a seed
    assert isinstance(drawn.details.seed, int)

    events = list(client.generate_stream(PROMPT, max_new_tokens=6))
    assert len(events) == 6 and all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == greedy.generated_text
    assert [e.token.id for e in events] == [t.id for t in d.tokens]
    assert events[-1].details.finish_reason == "length" and events[-1].details.generated_tokens == 6

    full = client.generate(PROMPT, max_new_tokens=4, return_full_text=True)
    assert full.generated_text.startswith(PROMPT) and full.details.generated_tokens == 4

    with pytest.raises(tgi_errors.ValidationError, match=r"`inputs` tokens \+ `max_new_tokens` "
                                                         r"must be <= 1024"):
        client.generate(PROMPT, max_new_tokens=WINDOW)
    # TGI's own checks and words, whichever engine serves (the client checks these too, so
    # they are sent raw)
    for parameters, message in [({"temperature": 0}, "`temperature` must be strictly positive"),
                                ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
                                ({"best_of": 2}, "you must use sampling when `best_of` is > 1")]:
        r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": parameters})
        assert r.status_code == 422 and r.json() == {
            "error": f"Input validation error: {message}", "error_type": "validation"}
    assert not any(a or b for a, b in ledger(url))


def test_text_generation_parameters(one_engine: tuple[str, str, str]) -> None:
    """Each parameter does what it does on TGI, or is refused by name where the engine has
    no equivalent."""
    engine, url, _ = one_engine
    client = text_generation.Client(url, timeout=30)
    refused = REFUSED[engine]
    base = client.generate(PROMPT, max_new_tokens=8).details.tokens

    def check(name: str, call) -> object:
        if name in refused:
            with pytest.raises(tgi_errors.ValidationError, match=f"`{name}`"):
                call()
            return None
        return call()

    stop = base[2].text  # the third token ends the generation
    out = check("stop", lambda: client.generate(PROMPT, max_new_tokens=8, stop_sequences=[stop]))
    if out is not None:
        assert out.details.finish_reason == "stop_sequence" and out.generated_text.endswith(stop)
        assert out.details.generated_tokens == 3

    out = check("top_n_tokens", lambda: client.generate(PROMPT, max_new_tokens=4, top_n_tokens=3))
    if out is not None:
        assert len(out.details.top_tokens) == 4
        for token, top in zip(out.details.tokens, out.details.top_tokens):
            assert len(top) == 3 and top[0].id == token.id  # greedy: the most likely one
            assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        streamed = list(client.generate_stream(PROMPT, max_new_tokens=4, top_n_tokens=2))
        assert all(len(e.top_tokens) == 2 for e in streamed)

    out = check("decoder_input_details",
                lambda: client.generate(PROMPT, max_new_tokens=2, decoder_input_details=True))
    if out is not None:
        assert out.details.prefill[0].logprob is None and len(out.details.prefill) > 3
        assert all(p.logprob is not None for p in out.details.prefill[1:])

    out = check("best_of", lambda: client.generate(PROMPT, max_new_tokens=4, best_of=2,
                                                   do_sample=True))
    if out is not None:
        others = out.details.best_of_sequences
        assert len(others) == 1 and others[0].generated_tokens == 4

    out = check("watermark", lambda: client.generate(PROMPT, max_new_tokens=2, watermark=True))
    if out is not None:
        assert out.details.generated_tokens == 2

    truncated = list(InferenceClient(base_url=url).text_generation(
        PROMPT, max_new_tokens=2, truncate=2, stream=True, details=True))
    assert truncated[-1].details.input_length == 2  # TGI keeps the prompt's last 2 tokens

    grammar = {"type": "json", "value": {"properties": {"a": {"type": "string"}}}}
    assert client.generate(PROMPT, max_new_tokens=2, grammar=grammar).details.generated_tokens == 2
    assert not any(a or b for a, b in ledger(url))


async def test_text_generation_async_client(one_engine: tuple[str, str, str]) -> None:
    _, url, _ = one_engine
    client = text_generation.AsyncClient(url, timeout=30)
    response = await client.generate(PROMPT, max_new_tokens=5)
    assert response.details.generated_tokens == 5
    events = [e async for e in client.generate_stream(PROMPT, max_new_tokens=5)]
    assert len(events) == 5 and events[-1].generated_text == response.generated_text
    many = await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=3) for _ in range(8)))
    assert {r.generated_text for r in many} == {many[0].generated_text}


def test_huggingface_hub_text_generation(one_engine: tuple[str, str, str]) -> None:
    _, url, _ = one_engine
    hf = InferenceClient(base_url=url)
    text = hf.text_generation(PROMPT, max_new_tokens=6)  # POST /: the prompt comes first
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    detailed = hf.text_generation(PROMPT, max_new_tokens=6, details=True, return_full_text=False)
    assert detailed.details.generated_tokens == 6 and detailed.details.finish_reason == "length"
    assert PROMPT + detailed.generated_text == text
    streamed = list(hf.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert len(streamed) == 6 and streamed[-1].generated_text == text
    assert streamed[-1].details.generated_tokens == 6 and streamed[-1].details.input_length > 0
    assert "".join(hf.text_generation(PROMPT, max_new_tokens=6, stream=True)) \
        == detailed.generated_text


def test_client_disconnect_aborts_a_translated_stream(one_engine: tuple[str, str, str]) -> None:
    _, url, replica = one_engine
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", url + "/generate_stream",
                         json={"inputs": PROMPT, "parameters": {"max_new_tokens": 900}}) as r:
            chunks = r.iter_raw()
            for _ in range(3):
                next(chunks)
            assert httpx.get(replica + "/sim/state").json()["running"] == 1
    settle(lambda: httpx.get(replica + "/sim/state").json()["running"], lambda n: not n, 5)
    state = httpx.get(replica + "/sim/state").json()
    assert state["running"] == 0 and state["aborted_total"] >= 1
    assert not any(a or b for a, b in ledger(url))


# --- engine errors reach TGI clients in TGI's shape and status ---

@pytest.mark.parametrize("one_engine", ["vllm"], indirect=True)  # the mapping is the same for all
def test_engine_errors_come_back_in_tgi_shape(one_engine: tuple[str, str, str]) -> None:
    _, url, replica = one_engine
    # The engine refuses the request (no such LoRA adapter: 404): TGI's 422 validation.
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "nope" in r.json()["error"] and set(r.json()) == {"error", "error_type"}
    # The engine fails (500): TGI's 424 generation error, which its clients raise.
    httpx.post(replica + "/sim/faults", json={"error_rate": 1.0}).raise_for_status()
    try:
        r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 424 and r.json()["error_type"] == "generation"
        assert "injected fault" in r.json()["error"]
        with pytest.raises(tgi_errors.GenerationError):
            text_generation.Client(url).generate(PROMPT, max_new_tokens=2)
        with pytest.raises(tgi_errors.GenerationError):
            list(text_generation.Client(url).generate_stream(PROMPT, max_new_tokens=2))
    finally:
        httpx.post(replica + "/sim/faults", json={"error_rate": 0.0}).raise_for_status()
    assert not any(a or b for a, b in ledger(url))


# --- OpenAI clients on TGI replicas, one too old for /v1/completions ---

@pytest.fixture(scope="module")
def tgi_gateway(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[str]:
    """Two models: one on a current TGI, one on TGI 1.4.3 (no /v1/completions)."""
    tok = ("--tokenizer", str(model_dir), *PACED)
    with sim("tgi", MODEL, 4096, *tok) as new, sim("tgi", MODEL, 4096, *tok, "--tgi-version", "1.4.3") as old:
        config = _config([], model_dir)
        config["models"] = [{**config["models"][0], "name": name, "replicas": [
            {"url": replica, "engine": "tgi", "name": name}]} for name, replica in
            (("3.3.6", new), ("1.4.3", old))]
        with gateway_server(tmp_path_factory.mktemp("tgi"), config) as (url, _):
            yield url


@pytest.mark.parametrize("version", ["3.3.6", "1.4.3"])
def test_openai_client_on_tgi(tgi_gateway: str, version: str, tokenizer: ModelTokenizer) -> None:
    url = tgi_gateway
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=version, messages=messages, max_tokens=5)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=version, messages=messages, max_tokens=5,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    done = client.completions.create(model=version, prompt=PROMPT, max_tokens=6, temperature=0)
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == tokenizer.count_text(PROMPT)
    streamed = list(client.completions.create(model=version, prompt=PROMPT, max_tokens=6,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert streamed[-1].usage.completion_tokens == 6
    assert streamed[-1].usage.prompt_tokens == done.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"

    # A stop string ends the text before it (OpenAI's rule), streamed or not.
    words = re.findall(r" \w+", done.choices[0].text)
    stopped = client.completions.create(model=version, prompt=PROMPT, max_tokens=6, temperature=0,
                                        stop=[words[2]])
    assert stopped.choices[0].text == "".join(words[:2]) and stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=version, prompt=PROMPT, max_tokens=6,
                                              temperature=0, stop=[words[2]], stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "".join(words[:2])

    logprobs = client.completions.create(model=version, prompt=PROMPT, max_tokens=3, temperature=0,
                                         logprobs=2, echo=version != "3.3.6")
    assert logprobs.choices[0].logprobs.token_logprobs[-1] < 0
    assert len(logprobs.choices[0].logprobs.tokens) >= 3
    if version != "3.3.6":  # translated: n has no TGI equivalent and is refused by name
        with pytest.raises(openai.BadRequestError, match="`n`"):
            client.completions.create(model=version, prompt=PROMPT, max_tokens=2, n=2)


def test_old_tgi_is_served_through_generate(tgi_gateway: str) -> None:
    url = tgi_gateway
    r = httpx.post(url + "/v1/completions", json={"model": "1.4.3", "prompt": PROMPT,
                                                  "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert r.text.count('"finish_reason":"length"') == 1
    assert not any(a or b for a, b in ledger(url))


# --- a pool mixing engines serves both APIs on every replica ---

def _engine_counts(replica: str) -> tuple[int, int]:
    state = httpx.get(replica + "/sim/state").json()
    return state["prompt_tokens_total"], state["generation_tokens_total"]


def _gateway_counts(gateway: str, replica: str) -> tuple[float, float]:
    text = httpx.get(gateway + "/metrics").text

    def counter(name: str) -> float:
        return sum(float(v) for labels, v in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)
                   if f'replica="{replica}"' in labels)
    return (counter("llm_gateway_prompt_tokens_total"),
            counter("llm_gateway_generation_tokens_total"))


def test_mixed_pool_serves_both_apis_on_every_replica(tmp_path: Path, model_dir: Path) -> None:
    tok = ("--tokenizer", str(model_dir), *PACED)
    with sim("vllm", MODEL, 4096, *tok) as a, sim("vllm", MODEL, 4096, *tok) as b, \
            sim("tgi", MODEL, 4096, *tok) as c:
        urls = {"vllm-a": a, "vllm-b": b, "tgi-c": c}
        config = _config([{"url": a, "engine": "vllm", "name": "vllm-a"},
                          {"url": b, "engine": "vllm", "name": "vllm-b"},
                          {"url": c, "engine": "tgi", "name": "tgi-c"}], model_dir,
                         balancer="round_robin")
        with gateway_server(tmp_path, config) as (url, _):
            served: dict[str, set[str]] = {"tgi": set(), "openai": set()}
            tgi = text_generation.Client(url, timeout=30)
            oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            hf = InferenceClient(base_url=url)
            for i in range(6):
                r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
                    "max_new_tokens": 3 + i, "details": True}})
                assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 3 + i
                served["tgi"].add(r.headers["x-gateway-replica"])
                raw = oai.completions.with_raw_response.create(model=MODEL, prompt=PROMPT,
                                                               max_tokens=2 + i)
                assert raw.parse().usage.completion_tokens == 2 + i
                served["openai"].add(raw.headers["x-gateway-replica"])
                assert len(list(tgi.generate_stream(PROMPT, max_new_tokens=4))) == 4
                # (details: a TGI stream without them reports no prompt count, so none is counted)
                assert len(list(hf.text_generation(PROMPT, max_new_tokens=2, stream=True,
                                                   details=True))) == 2
                chunks = list(oai.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                    stream=True))
                assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) == 3
            assert served == {"tgi": set(urls), "openai": set(urls)}
            assert ledger(url) == [(0, 0)] * 3
            for name, replica in urls.items():  # every token the engines counted, no more
                assert _gateway_counts(url, name) == _engine_counts(replica), name
            # TTFT of every TGI stream, labelled with the client's API whichever engine served
            assert _metric(url, "llm_gateway_time_to_first_token_seconds_count", 'api="tgi"') == 12

            # A replica failing before its first token: retried on another, as on the same path.
            httpx.post(a + "/sim/faults", json={"error_rate": 1.0}).raise_for_status()
            for _ in range(6):
                assert len(list(tgi.generate_stream(PROMPT, max_new_tokens=3))) == 3
                assert tgi.generate(PROMPT, max_new_tokens=3).details.generated_tokens == 3
            assert _metric(url, "llm_gateway_retries_total", 'replica="vllm-a"') > 0
            assert ledger(url) == [(0, 0)] * 3


def _metric(gateway: str, name: str, label: str) -> float:
    text = httpx.get(gateway + "/metrics").text
    return sum(float(v) for labels, v in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)
               if label in labels)


@pytest.mark.parametrize("one_engine", ["vllm"], indirect=True)
def test_greedy_tgi_request_on_vllm_returns_the_direct_openai_text(
        one_engine: tuple[str, str, str]) -> None:
    _, url, replica = one_engine
    through = text_generation.Client(url).generate(PROMPT, max_new_tokens=12).generated_text
    direct = openai.OpenAI(base_url=replica + "/v1", api_key="unused").completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert through == direct


def test_tgi_stream_over_vllm_chunks_of_several_tokens(tmp_path: Path, model_dir: Path) -> None:
    """vLLM with --stream-interval 4 writes the first token alone, then four to a chunk (text,
    logprobs and token_ids of all four): a TGI client still gets one event per token, the
    same ids, texts and logprobs as from a vLLM writing one token a chunk."""
    args = ("--tokenizer", str(model_dir), *PACED)
    with sim("vllm", MODEL, 4096, *args) as one, \
            sim("vllm", MODEL, 4096, *args, "--stream-interval", "4") as grouped:
        chunks = httpx.post(grouped + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True, "logprobs": 1,
            "return_token_ids": True}).text.split("\n\n")
        sizes = [len(orjson.loads(c[6:])["choices"][0]["token_ids"]) for c in chunks
                 if c.startswith("data: {")]
        assert sizes == [1, 4, 4, 1]
        streams = []
        for replica in (one, grouped):
            config = _config([{"url": replica, "engine": "vllm"}], model_dir)
            with gateway_server(tmp_path, config) as (url, _):
                client = text_generation.Client(url, timeout=30)
                events = list(client.generate_stream(PROMPT, max_new_tokens=10,
                                                     top_n_tokens=2))
                streams.append([(e.token.id, e.token.text, e.token.logprob,
                                 [(t.id, t.text) for t in e.top_tokens or []]) for e in events])
                assert events[-1].details.generated_tokens == 10
                assert events[-1].generated_text == "".join(e.token.text for e in events)
        assert len(streams[1]) == 10 and streams[1] == streams[0]
