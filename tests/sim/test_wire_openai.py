"""OpenAI-dialect replicas (vllm, sglang, llamacpp) driven by the real ``openai`` client."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.sim.conftest import FAST

OPENAI_DIALECTS = ["vllm", "sglang", "llamacpp"]
MESSAGES = [{"role": "user", "content": "Hello world! Please write a short story about a cat."}]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("dialect", OPENAI_DIALECTS)
def test_chat_and_completions(replica, dialect: str) -> None:
    c = client(replica(dialect, *FAST))
    chat = c.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=7, seed=3)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 7 and len(chat.choices[0].message.content.split()) == 7
    again = c.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=7, seed=3)
    assert again.choices[0].message.content == chat.choices[0].message.content  # seeded
    natural = c.chat.completions.create(model="sim-model", messages=MESSAGES)
    assert natural.choices[0].finish_reason == "stop" and 6 <= natural.usage.completion_tokens <= 18
    comp = c.completions.create(model="sim-model", prompt="The quick brown fox", max_tokens=5)
    assert comp.usage.completion_tokens == 5 and comp.choices[0].finish_reason == "length"
    ids = c.completions.create(model="sim-model", prompt=[1, 2, 3, 4], max_tokens=2)
    assert ids.usage.prompt_tokens == 4


@pytest.mark.parametrize("dialect", OPENAI_DIALECTS)
def test_streaming_with_usage(replica, dialect: str) -> None:
    c = client(replica(dialect, *FAST))
    chunks = list(c.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(tokens) == 6  # one event per token
    # vLLM and SGLang end on the last token's chunk; llama.cpp in a chunk of its own after it
    ending = chunks[-2] if dialect == "llamacpp" else tokens[-1]
    assert ending.choices[0].finish_reason == "length"
    assert dialect != "llamacpp" or ending.choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    comp = list(c.completions.create(model="sim-model", prompt="hello", max_tokens=4, stream=True))
    assert "".join(ch.choices[0].text for ch in comp).count(" ") == 4
    # llama.cpp's last completion chunk always carries usage; the others only when asked
    assert (comp[-1].usage is None) == (dialect != "llamacpp")


def test_continuous_usage_stats(replica) -> None:
    c = client(replica("vllm", *FAST))
    chunks = list(c.completions.create(model="sim-model", prompt="hello", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [ch.usage.completion_tokens for ch in chunks] == [1, 2, 3, 3]


def test_raw_sse_framing(replica) -> None:
    base = replica("vllm", *FAST)
    with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        raw = r.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-2]) and len(events) == 4


def test_vllm_errors(replica) -> None:
    c = client(replica("vllm", *FAST, max_model_len=64))
    long_prompt = "the quick brown fox " * 40
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="sim-model", prompt=long_prompt)
    err = exc.value
    assert err.status_code == 400 and err.body["type"] == "BadRequestError" and err.body["param"] == "input_tokens"
    assert err.body["message"].startswith("This model's maximum context length is 64 tokens. However, your "
                                          "prompt contains at least 65 input tokens")
    # vLLM 0.32: a prompt that fits has max_tokens cut to what is left, and is answered
    capped = c.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=60)
    assert capped.usage.prompt_tokens + capped.usage.completion_tokens == 64
    assert capped.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError) as exc:
        c.chat.completions.create(model="nope", messages=MESSAGES)
    assert exc.value.body == {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=0)
    assert "max_tokens must be at least 1" in exc.value.message
    r = httpx.post(f"{replica('vllm', *FAST, max_model_len=64)}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{replica('vllm', *FAST, max_model_len=64)}/v1/chat/completions",
                   json={"messages": MESSAGES, "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_vllm_flat_errors(replica) -> None:
    base = replica("vllm", *FAST, "--vllm-flat-errors", max_model_len=64)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 100})
    body = r.json()
    assert r.status_code == 400 and body["object"] == "error" and body["code"] == 400
    assert re.fullmatch(r"This model's maximum context length is 64 tokens\. However, you requested (\d+) tokens "
                        r"\((\d+) in the messages, 100 in the completion\)\. Please reduce the length of the "
                        r"messages or completion\.", body["message"])
    with pytest.raises(openai.BadRequestError):
        client(base).completions.create(model="sim-model", prompt="hi", max_tokens=100)


def test_sglang_and_llamacpp_errors(replica) -> None:
    sg = client(replica("sglang", *FAST, max_model_len=64))
    with pytest.raises(openai.BadRequestError) as exc:
        sg.completions.create(model="sim-model", prompt="the quick brown fox " * 40)
    assert exc.value.body["object"] == "error"
    assert exc.value.body["message"].endswith("is longer than the model's context length (64 tokens).")
    with pytest.raises(openai.NotFoundError):
        sg.completions.create(model="nope", prompt="hi")
    base = replica("llamacpp", *FAST, max_model_len=64)
    lc = client(base)
    with pytest.raises(openai.BadRequestError) as exc:
        lc.completions.create(model="anything", prompt="the quick brown fox " * 40)
    body = exc.value.body
    assert body["type"] == "exceed_context_size_error" and body["n_ctx"] == 64 and body["n_prompt_tokens"] > 64
    # llama.cpp never rejects max_tokens: it stops at the window with finish_reason "length"
    out = lc.completions.create(model="anything", prompt="hello", max_tokens=1000)
    assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 64
    with pytest.raises(openai.NotFoundError):
        lc.embeddings.create(model="x", input="hi")


def test_discovery_routes(replica) -> None:
    v = replica("vllm", *FAST)
    assert httpx.get(f"{v}/v1/models").json()["data"][0]["max_model_len"] == 4096
    assert httpx.get(f"{v}/health").status_code == 200 and "version" in httpx.get(f"{v}/version").json()
    tok = httpx.post(f"{v}/tokenize", json={"messages": MESSAGES}).json()
    chat = client(v).chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=1)
    assert tok["count"] == chat.usage.prompt_tokens == len(tok["tokens"]) and tok["max_model_len"] == 4096
    sg = replica("sglang", *FAST)
    card = httpx.get(f"{sg}/v1/models").json()["data"][0]
    assert card["owned_by"] == "sglang" and card["max_model_len"] == 4096
    assert httpx.get(f"{sg}/server_info").json()["context_length"] == 4096
    lc = replica("llamacpp", *FAST)
    props = httpx.get(f"{lc}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 4096 and props["total_slots"] == 256
    assert "im_start" in props["chat_template"]
    assert httpx.get(f"{lc}/health").json() == {"status": "ok"}
    assert httpx.get(f"{lc}/v1/models").json()["data"][0]["meta"]["n_ctx_train"] == 4096


@pytest.mark.parametrize("dialect,names", [
    ("vllm", ["vllm:num_requests_running{", "vllm:kv_cache_usage_perc{", "vllm:generation_tokens_total{",
              'finished_reason="length"', 'vllm:time_to_first_token_seconds_bucket{model_name="sim-model",engine="0",le="0.001"}']),
    ("sglang", ["sglang:num_queue_reqs{", "sglang:token_usage{", "sglang:inter_token_latency_seconds_bucket"]),
    ("llamacpp", ["llamacpp:prompt_tokens_total ", "llamacpp:requests_deferred ", "llamacpp:tokens_predicted_total "]),
])
def test_metrics_names(replica, dialect: str, names: list[str]) -> None:
    base = replica(dialect, *FAST)
    client(base).completions.create(model="sim-model", prompt="hi", max_tokens=2)
    text = httpx.get(f"{base}/metrics").text
    for name in names:
        assert name in text, name
