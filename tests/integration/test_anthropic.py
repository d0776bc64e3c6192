"""Anthropic's Messages API through the gateway, translated onto engines without it (simulated
SGLang and TGI replicas: their chat completions), with the real ``anthropic`` client: whole
and streamed answers equal to the same chat's, usage and stop reasons, ``count_tokens``, keys
sent as ``x-api-key``, the window, what is refused by name, bad input in Anthropic's error
shape, and the metrics' ``api="anthropic"``. Pass-through to engines that serve the API is
tested on real vLLM and llama.cpp (tests/real_engines/test_real_anthropic.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import orjson
import pytest

from access_support import key
from scrape import samples
from support import gateway_server, settle, sim

MODEL = "sim-model"
WINDOW = 1024
SECRET = "sk-anthropic-test"
ENGINES = ("sglang", "tgi")
CONVERSATION = [{"role": "user", "content": "Tell me about the gateway"},
                {"role": "assistant", "content": [{"type": "text", "text": "It routes."}]},
                {"role": "user", "content": [{"type": "text", "text": "And"},
                                             {"type": "text", "text": " then?"}]}]
SYSTEM = "You are brief."
GREEDY = {"temperature": 0}  # the client no longer names sampling parameters (anthropic 2.x)


@pytest.fixture(scope="module", params=ENGINES)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           model_dir: Path) -> Iterator[tuple[str, str, str]]:
    """(engine, gateway URL, replica URL): one simulated replica of the engine, keys on."""
    engine = request.param
    with sim(engine, MODEL, 4096, "--tokenizer", str(model_dir), "--profile", "paced",
             "--ttft-ms", "2", "--itl-ms", "1") as replica:
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir),
                              "max_model_len": WINDOW,
                              "replicas": [{"url": replica, "engine": engine}]}],
                  "auth": {"keys": [key("team", SECRET)]}, "admin_token": "t"}
        with gateway_server(tmp_path_factory.mktemp(engine), config) as (url, _):
            yield engine, url, replica


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=SECRET, max_retries=0, timeout=30)


def chat(replica: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """The same conversation as a chat (as vLLM converts it: one text block is a string,
    several stay parts), asked of the replica directly (greedy)."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Tell me about the gateway"},
                {"role": "assistant", "content": "It routes."},
                {"role": "user", "content": CONVERSATION[2]["content"]}]
    return httpx.post(replica + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        **extra}, timeout=30).json()


def test_whole_and_streamed_answers_read_as_the_same_chat(served: tuple[str, str, str]) -> None:
    _, url, replica = served
    direct = chat(replica, 12)
    text = direct["choices"][0]["message"]["content"]
    whole = client(url).messages.create(model=MODEL, max_tokens=12, system=SYSTEM,
                                        messages=CONVERSATION, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == text
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.input_tokens == direct["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == 12

    with client(url).messages.stream(model=MODEL, max_tokens=12, system=SYSTEM,
                                     messages=CONVERSATION, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        direct["usage"]["prompt_tokens"], 12)
    raw = [k for k in kinds if k != "text"]  # the SDK adds a `text` event per delta
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}

    counted = client(url).messages.count_tokens(model=MODEL, system=SYSTEM,
                                                messages=CONVERSATION)
    assert counted.input_tokens == direct["usage"]["prompt_tokens"]


def test_the_wire_as_vllm_writes_it(served: tuple[str, str, str]) -> None:
    """The events' bytes: names, order, block indices, the stop reason and usage in
    ``message_delta``, and ``message_start``'s usage counted before the engine reports it."""
    _, url, replica = served
    response = httpx.post(url + "/v1/messages", headers={"x-api-key": SECRET}, json={
        "model": MODEL, "max_tokens": 3, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.content.split(b"\n\n") if e]
    names = [e.split(b"\n")[0] for e in events]
    assert names == [b"event: message_start", b"event: content_block_start",
                     *[b"event: content_block_delta"] * 3, b"event: content_block_stop",
                     b"event: message_delta", b"event: message_stop"]
    data = [orjson.loads(e.split(b"\n", 1)[1].removeprefix(b"data: ")) for e in events]
    prompt = chat(replica, 1, messages=[{"role": "user", "content": "hi"}])["usage"]
    assert data[0]["message"]["usage"] == {"input_tokens": prompt["prompt_tokens"],
                                           "output_tokens": 0}
    assert data[0]["message"]["content"] == [] and data[0]["message"]["stop_reason"] is None
    assert data[1] == {"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in data[2:5])
    assert data[5] == {"type": "content_block_stop", "index": 0}
    assert data[6] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                          "stop_sequence": None},
                       "usage": {"input_tokens": prompt["prompt_tokens"], "output_tokens": 3}}
    assert data[7] == {"type": "message_stop"}
    # Near the window, admission counts the prompt exactly: message_start takes that count.
    with httpx.stream("POST", url + "/v1/messages", headers={"x-api-key": SECRET}, json={
            "model": MODEL, "max_tokens": WINDOW - 2 * prompt["prompt_tokens"], "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}, timeout=30) as near:
        lines = near.iter_lines()
        first = next(lines, "") + next(lines, "")
    assert f'"usage":{{"input_tokens":{prompt["prompt_tokens"]},' in first, first


def test_stop_sequences_where_the_engine_says_which_matched(
        served: tuple[str, str, str]) -> None:
    engine, url, replica = served
    text = chat(replica, 12)["choices"][0]["message"]["content"]
    word = text.split()[2]
    ask = dict(model=MODEL, max_tokens=12, system=SYSTEM, messages=CONVERSATION,
               extra_body=GREEDY, stop_sequences=[word])
    if engine == "tgi":  # its chat answer does not say whether a stop string matched
        with pytest.raises(anthropic.BadRequestError, match="`stop_sequences` cannot be "
                                                            "honoured by the tgi replicas"):
            client(url).messages.create(**ask)
        return
    got = client(url).messages.create(**ask)
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == word
    assert text.startswith(got.content[0].text) and word not in got.content[0].text
    with client(url).messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)
    assert final.content[0].text == got.content[0].text


@pytest.mark.parametrize("block, named", [
    ({"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}},
     "content blocks of type `image`"),
    ({"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
     "`cache_control` hints"),
    ({"type": "thinking", "thinking": "hmm", "signature": "s"}, "content blocks of type `thinking`"),
])
def test_what_a_chat_cannot_carry_is_refused_by_name(served: tuple[str, str, str],
                                                      block: dict, named: str) -> None:
    engine, url, _ = served
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(url).messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [block]}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert f"{named} cannot be honoured by the {engine} replicas" in refused.value.message
    with pytest.raises(anthropic.BadRequestError, match="`thinking` cannot be honoured"):
        client(url).messages.create(model=MODEL, max_tokens=2000, messages=CONVERSATION,
                                    thinking={"type": "enabled", "budget_tokens": 1024})


def test_bad_input_is_a_4xx_in_anthropic_s_shape(served: tuple[str, str, str]) -> None:
    _, url, _ = served
    headers = {"x-api-key": SECRET, "anthropic-version": "2023-06-01"}

    def post(body: bytes, **extra: str) -> httpx.Response:
        return httpx.post(url + "/v1/messages", content=body, timeout=10,
                          headers={**headers, "content-type": "application/json", **extra})

    cases = [
        (post(b"{not json"), 400, "invalid_request_error", "not valid JSON"),
        (post(orjson.dumps({"model": MODEL, "messages": CONVERSATION})), 400,
         "invalid_request_error", "`max_tokens` is required"),
        (post(orjson.dumps({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "video", "url": "x"}]}]})), 400,
         "invalid_request_error", 'unknown content block type "video"'),
        (post(orjson.dumps({"model": MODEL, "max_tokens": 4, "messages": CONVERSATION}),
              **{"x-api-key": "sk-wrong"}), 401, "authentication_error", "API key"),
        (post(orjson.dumps({"model": "no-such", "max_tokens": 4, "messages": CONVERSATION})),
         404, "not_found_error", "no-such"),
        (post(orjson.dumps({"model": MODEL, "max_tokens": WINDOW, "messages": CONVERSATION})),
         400, "invalid_request_error", "maximum context length is 1024 tokens"),
    ]
    for response, status, kind, words in cases:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == kind, body
        assert words in body["error"]["message"], body
    assert SECRET not in httpx.get(url + "/metrics").text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=CONVERSATION)
    wait_settled(url)


def test_metrics_say_anthropic(served: tuple[str, str, str]) -> None:
    _, url, _ = served
    with client(url).messages.stream(model=MODEL, max_tokens=4, messages=CONVERSATION) as s:
        s.until_done()
    families = samples(url)
    ttft = [labels for name, labels, value in families
            if name == "llm_gateway_time_to_first_token_seconds_count" and value]
    assert any(labels.get("api") == "anthropic" for labels in ttft), ttft
    requests = [labels for name, labels, value in families
                if name == "llm_gateway_requests_total" and value]
    assert any(labels.get("api") == "anthropic" for labels in requests), requests
    wait_settled(url)


def wait_settled(url: str) -> None:
    def loads() -> list[tuple[int, int]]:
        listed = httpx.get(url + "/admin/replicas",
                           headers={"authorization": "Bearer t"}).json()["replicas"]
        return [(r["outstanding_tokens"], r["in_flight"]) for r in listed]

    assert not any(a or b for a, b in settle(loads, lambda now: not any(a or b for a, b in now), 5))


def test_an_unknown_method_or_route_under_messages_answers_in_anthropic_s_shape(
        served: tuple[str, str, str]) -> None:
    _, url, _ = served
    for method, path, status in (("GET", "/v1/messages", 405),
                                 ("POST", "/v1/messages/batches", 404)):
        response = httpx.request(method, url + path, headers={"x-api-key": SECRET})
        assert response.status_code == status
        assert response.json()["type"] == "error" and response.json()["error"]["type"] in (
            "not_found_error", "invalid_request_error")


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_passed_through_to_engines_that_serve_it(engine: str, tmp_path: Path,
                                                 model_dir: Path) -> None:
    """Simulated vLLM and llama-server replicas serve /v1/messages themselves (as the real
    ones do, tests/real_engines/test_real_anthropic.py): the gateway passes the request and
    its answer through, reading usage and the first token off Anthropic's events."""
    with sim(engine, MODEL, 4096, "--tokenizer", str(model_dir)) as replica:
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir),
                              "max_model_len": WINDOW,
                              "replicas": [{"url": replica, "engine": engine}]}],
                  "admin_token": "t"}
        with gateway_server(tmp_path, config) as (url, _):
            direct = chat(replica, 12)
            sdk = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=30)
            whole = sdk.messages.create(model=MODEL, max_tokens=12, system=SYSTEM,
                                        messages=CONVERSATION, extra_body=GREEDY)
            assert whole.content[0].text == direct["choices"][0]["message"]["content"]
            assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
            assert whole.usage.input_tokens == direct["usage"]["prompt_tokens"]
            with sdk.messages.stream(model=MODEL, max_tokens=12, system=SYSTEM,
                                     messages=CONVERSATION, extra_body=GREEDY) as stream:
                final = stream.get_final_message()
            assert final.content[0].text == whole.content[0].text
            assert (final.usage.input_tokens, final.usage.output_tokens) == (
                whole.usage.input_tokens, 12)
            ttft = [value for name, labels, value in samples(url)
                    if name == "llm_gateway_time_to_first_token_seconds_count"
                    and labels.get("api") == "anthropic"]
            assert sum(ttft) == 1  # the stream's, taken at its first content_block_delta
            wait_settled(url)
