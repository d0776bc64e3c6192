"""The TGI dialect driven by ``huggingface_hub.InferenceClient`` and the ``text_generation`` client."""

from __future__ import annotations

import threading

import httpx
import pytest
import text_generation
import text_generation.errors
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hf_errors

from tests.sim.conftest import FAST, state
from tests.support import wait_until


def test_huggingface_hub_text_generation(replica) -> None:
    hf = InferenceClient(base_url=replica("tgi", *FAST))
    text = hf.text_generation("Hello world", max_new_tokens=5)
    # POST / (the client's route): return_full_text defaults to true for a text-generation model
    assert text.startswith("Hello world ") and len(text.split()) == 2 + 5
    out = hf.text_generation("Hello world", max_new_tokens=5, details=True, seed=7, do_sample=True)
    d = out.details
    assert d.finish_reason == "length" and d.generated_tokens == 5 and d.seed == 7 and len(d.tokens) == 5
    # greedy decoding (TGI's default) ignores the seed and reports none
    assert hf.text_generation("Hello world", max_new_tokens=5, details=True, seed=7).details.seed is None
    assert "Hello world" + "".join(t.text for t in d.tokens) == out.generated_text
    pieces = list(hf.text_generation("Hello world", max_new_tokens=4, stream=True))
    assert len(pieces) == 4
    events = list(hf.text_generation("Hello world", max_new_tokens=4, stream=True, details=True))
    assert events[-1].generated_text == "".join(pieces) or events[-1].details.generated_tokens == 4
    assert events[-1].details.finish_reason == "length" and all(e.generated_text is None for e in events[:-1])
    natural = hf.text_generation("Hello world", details=True)
    assert natural.details.finish_reason == "eos_token"


def test_huggingface_hub_errors(replica) -> None:
    hf = InferenceClient(base_url=replica("tgi", *FAST, max_model_len=64))
    with pytest.raises(hf_errors.ValidationError) as exc:
        hf.text_generation("Hello world", max_new_tokens=100)
    assert "`inputs` tokens + `max_new_tokens` must be <= 64. Given: " in str(exc.value)
    with pytest.raises(hf_errors.ValidationError):
        list(hf.text_generation("Hello world", max_new_tokens=100, stream=True))


def test_text_generation_client(replica) -> None:
    base = replica("tgi", *FAST, max_model_len=64)
    c = text_generation.Client(base)
    r = c.generate("Hello world", max_new_tokens=6)
    assert r.details.generated_tokens == 6 and r.details.finish_reason == "length"
    events = list(c.generate_stream("Hello world", max_new_tokens=6))
    assert len(events) == 6 and events[-1].generated_text is not None and events[-1].details.generated_tokens == 6
    with pytest.raises(text_generation.errors.ValidationError) as exc:
        c.generate("Hello world", max_new_tokens=100)
    assert str(exc.value).startswith("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 64.")
    with pytest.raises(text_generation.errors.ValidationError):
        list(c.generate_stream("Hello world", max_new_tokens=100))


async def test_text_generation_async_client(replica) -> None:
    c = text_generation.AsyncClient(replica("tgi", *FAST))
    r = await c.generate("Hello world", max_new_tokens=3)
    assert r.details.generated_tokens == 3
    events = [e async for e in c.generate_stream("Hello world", max_new_tokens=3)]
    assert [e.token.text for e in events] == [t.text for t in r.details.tokens]  # same seed from the prompt


def test_overloaded(replica) -> None:
    base = replica("tgi", "--profile", "paced", "--ttft-ms", "5000", "--max-concurrent-requests", "1")
    def hold() -> None:
        try:
            httpx.post(f"{base}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}}, timeout=30)
        except httpx.HTTPError:
            pass  # the replica is stopped under it at the end of the module

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    wait_until(lambda: state(base)["in_flight"] == 1)
    c = text_generation.Client(base)
    with pytest.raises(text_generation.errors.OverloadedError):
        c.generate("hi", max_new_tokens=1)
    r = httpx.post(f"{base}/generate", json={"inputs": "hi"})
    assert r.status_code == 429 and r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    with pytest.raises(text_generation.errors.OverloadedError):  # in-stream, inside HTTP 200
        list(c.generate_stream("hi", max_new_tokens=1))


def test_tgi_wire_details(replica) -> None:
    base = replica("tgi", *FAST, max_model_len=64)
    r = httpx.post(f"{base}/generate", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 3}})
    assert r.json().keys() == {"generated_text"}
    assert r.headers["x-prompt-tokens"] and r.headers["x-generated-tokens"] == "3"
    assert r.headers["x-compute-type"] and "x-queue-time" in r.headers
    r = httpx.post(f"{base}/", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 3}})
    assert isinstance(r.json(), list)
    r = httpx.post(f"{base}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 0}})
    assert r.status_code == 422 and r.json() == {
        "error": "Input validation error: `max_new_tokens` must be strictly positive", "error_type": "validation"}
    with httpx.stream("POST", f"{base}/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 0}}) as s:
        assert s.status_code == 200 and s.read().startswith(b'data: {"error":')
    with httpx.stream("POST", f"{base}/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}) as s:
        raw = s.read()
    events = raw.split(b"\n\n")
    assert len(events) == 3 and events[-1] == b"" and all(e.startswith(b"data: {") for e in events[:-1])
    assert b"[DONE]" not in raw
    info = httpx.get(f"{base}/info").json()
    assert info["max_total_tokens"] == 64 and info["max_input_tokens"] == 63 and info["max_concurrent_requests"] == 128
    toks = httpx.post(f"{base}/tokenize", json={"inputs": "Hello world"}).json()
    assert toks[0].keys() == {"id", "text", "start", "stop"}
    assert httpx.get(f"{base}/v1/models").json()["data"][0].keys() == {"id", "object", "created", "owned_by"}
    text = httpx.get(f"{base}/metrics").text
    for name in ("tgi_request_count ", "tgi_queue_size ", "tgi_request_failure{err=\"validation\"}",
                 "tgi_request_duration_bucket", "tgi_batch_current_size "):
        assert name in text, name


def test_tgi_sse_no_space(replica) -> None:
    base = replica("tgi", *FAST, "--tgi-sse-no-space")
    with httpx.stream("POST", f"{base}/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}) as s:
        raw = s.read()
    assert raw.startswith(b'data:{"index":1,') and b"data: " not in raw
    c = text_generation.Client(base)  # the old client parses both
    assert len(list(c.generate_stream("Hello", max_new_tokens=2))) == 2


def test_tgi_messages_api(replica) -> None:
    import openai
    base = replica("tgi", *FAST, max_model_len=64)
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    out = c.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.usage.completion_tokens == 3
    chunks = list(c.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True))
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 3
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    with httpx.stream("POST", f"{base}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}) as s:
        assert s.status_code == 200 and b'"http_status_code":422' in s.read()
