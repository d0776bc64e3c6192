"""Anthropic's Messages API through the gateway on real engines, with the real ``anthropic``
client: passed through to vLLM 0.32 and llama-server 0.3.36 (both serve ``/v1/messages``),
and translated onto their chat completions when they are registered as plain
OpenAI-compatible engines (``engine: openai``, which has no Messages API), as an SGLang or
TGI replica would be served.

The translation must read as the engine's own Messages API: on vLLM, whose converter the
gateway's mirrors, the same events with the same payloads (ids aside); on llama.cpp, the
text of the same chat's greedy answer, with its stop reason and usage, at every length
(the random weights end many answers inside a UTF-8 character).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import orjson
import pytest

from engines import Engine, VllmSpec, llama_server, vllm_python, vllms
from gateway.protocol.anthropic import parse_messages
from support import gateway_server

GREEDY = {"temperature": 0}  # the client no longer names sampling parameters (anthropic 2.x)
SYSTEM = "You answer in one line."
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello world"}]},
    {"system": SYSTEM, "messages": [
        {"role": "user", "content": "The quick brown fox"},
        {"role": "assistant", "content": [{"type": "text", "text": "jumps"}]},
        {"role": "user", "content": [{"type": "text", "text": "caf\u00e9 \u4f60\u597d"},
                                     {"type": "text", "text": " \U0001f680 and then?"}]}]},
    {"system": [{"type": "text", "text": SYSTEM}], "messages": [
        {"role": "user", "content": "12"}, {"role": "assistant", "content": "34"},
        {"role": "user", "content": "56"}]},
]


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tiny_gguf: Path) -> Iterator[dict[str, Engine]]:
    # A tool-call parser: vLLM takes a named tool_choice only with one (pythonic: it needs
    # no special token the tiny tokenizer lacks; a forced call's arguments come from
    # structured output anyway).
    spec = VllmSpec(("--enable-auto-tool-choice", "--tool-call-parser", "pythonic"))
    with llama_server(tiny_gguf, "-np", "2") as llama, vllms(tiny_model, spec) as (vllm,):
        yield {"vllm": vllm, "llamacpp": llama}


@pytest.fixture(scope="module")
def gateways(engines: dict[str, Engine], tiny_model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A gateway per (engine, how): ``vllm`` and ``llamacpp`` pass through; ``vllm-chat``
    and ``llamacpp-chat`` translate onto the same engines' chat completions."""
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name, engine in engines.items():
            for how, kind in ((name, name), (f"{name}-chat", "openai")):
                config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model),
                                      "replicas": [{"url": engine.url, "engine": kind}]}],
                          "health": {"interval": 0.5, "timeout": 10.0}}
                urls[how], _ = stack.enter_context(
                    gateway_server(tmp_path_factory.mktemp(how), config))
        yield urls


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def folded(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage with the prompt's cached part counted in (how much of a prompt an engine finds
    in its cache depends on what it served before)."""
    if usage is None or "input_tokens" not in usage:  # llama-server's message_delta: output
        return usage
    cached = usage.get("cache_read_input_tokens") or 0
    return {**{k: v for k, v in usage.items() if k != "cache_read_input_tokens"},
            "input_tokens": usage["input_tokens"] + cached}


def stream_events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed message's events as (name, payload), consecutive deltas of a block merged
    (an engine under load puts several tokens in one chat chunk), ids blanked, usage
    folded."""
    response = httpx.post(url + "/v1/messages", json={**body, "stream": True}, timeout=120)
    assert response.status_code == 200, response.text
    out: list[tuple[str, dict[str, Any]]] = []
    for event in response.content.split(b"\n\n"):
        if not event.strip():
            continue
        name, _, data = event.partition(b"\n")
        payload = orjson.loads(data.removeprefix(b"data:").strip())
        if "message" in payload:
            payload["message"]["id"] = "-"
            payload["message"]["usage"] = folded(payload["message"].get("usage"))
        if "usage" in payload:
            payload["usage"] = folded(payload["usage"])
        if "id" in payload.get("content_block", {}):  # a tool call's id, new each time
            payload["content_block"]["id"] = "-"
        if out and out[-1][0] == "content_block_delta" and name.endswith(b"content_block_delta") \
                and out[-1][1]["index"] == payload["index"]:
            delta = out[-1][1]["delta"]
            field = "text" if delta["type"] == "text_delta" else "partial_json"
            delta[field] += payload["delta"][field]
            continue
        out.append((name.removeprefix(b"event:").strip().decode(), payload))
    return out


def whole(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + "/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    content = [{**b, "id": "-"} if "id" in b else b for b in answer["content"]]
    return {**answer, "id": "-", "content": content, "usage": folded(answer.get("usage"))}


# A forced tool call: vLLM constrains the arguments to the tool's schema (structured
# output). The random weights fill them with whitespace the grammar allows, so they never end
# within max_tokens: vLLM's whole answer is then a 400 (its JSON parser's), the gateway's
# translation a tool_use block with input {} (llama-server's rule).
TOOL_USE = {"max_tokens": 40, "tools": [{"name": "get_weather", "description": "The weather",
                                         "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
    "required": ["city"], "additionalProperties": False}}],
    "tool_choice": {"type": "tool", "name": "get_weather"},
    "messages": [{"role": "user", "content": "Weather in Paris?"}]}


@pytest.mark.parametrize("conversation", [*CONVERSATIONS, TOOL_USE],
                         ids=[*map(str, range(len(CONVERSATIONS))), "tool_use"])
def test_vllm_passed_through_and_translated_read_as_vllm_s_own(
        engines: dict[str, Engine], gateways: dict[str, str],
        conversation: dict[str, Any]) -> None:
    """The same greedy request: to vLLM's /v1/messages directly, through the gateway (pass
    through), and through the gateway onto vLLM's chat completions (translated)."""
    body = {"model": "tiny", "max_tokens": 12, **GREEDY, **conversation}
    own = engines["vllm"].url
    expected = stream_events(own, body)
    assert [name for name, _ in expected][:2] == ["message_start", "content_block_start"]
    assert stream_events(gateways["vllm"], body) == expected
    assert stream_events(gateways["vllm-chat"], body) == expected
    if conversation is TOOL_USE:
        refused = httpx.post(own + "/v1/messages", json=body, timeout=120)
        assert refused.status_code == 400 and "Expecting" in refused.json()["error"]["message"]
        passed = httpx.post(gateways["vllm"] + "/v1/messages", json=body, timeout=120)
        # the engine's words, in Anthropic's own error type (vLLM writes its exception's name)
        assert (passed.status_code, passed.json()["error"]) == (400, {
            "type": "invalid_request_error", "message": refused.json()["error"]["message"]})
        translated = whole(gateways["vllm-chat"], body)
        assert translated["stop_reason"] == "max_tokens"
        assert translated["content"] == [{"type": "tool_use", "id": "-", "name": "get_weather",
                                          "input": {}}]
        return
    expected_whole = whole(own, body)
    assert whole(gateways["vllm"], body) == expected_whole
    assert whole(gateways["vllm-chat"], body) == expected_whole


def test_the_real_client_on_vllm(engines: dict[str, Engine], gateways: dict[str, str]) -> None:
    for how in ("vllm", "vllm-chat"):
        sdk = client(gateways[how])
        message = sdk.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY,
                                      **CONVERSATIONS[1])
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 10
        with sdk.messages.stream(model="tiny", max_tokens=10, extra_body=GREEDY,
                                 **CONVERSATIONS[1]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == message.content[0].text == final.content[0].text
        assert final.usage.input_tokens == message.usage.input_tokens > 0
        # count_tokens: the gateway counts (tokenizer and chat template), vLLM agrees
        for conversation in CONVERSATIONS:
            counted = sdk.messages.count_tokens(model="tiny", **conversation)
            own = httpx.post(engines["vllm"].url + "/v1/messages/count_tokens",
                             json={"model": "tiny", **conversation}, timeout=60).json()
            assert counted.input_tokens == own["input_tokens"], conversation
        assert sdk.messages.count_tokens(model="tiny", **CONVERSATIONS[1]).input_tokens == \
            message.usage.input_tokens
        # past the window (vLLM's 1024): the gateway's 400, before any engine sees it
        with pytest.raises(anthropic.BadRequestError, match="maximum context length is 1024"):
            sdk.messages.create(model="tiny", max_tokens=1020, **CONVERSATIONS[1])


def test_llamacpp_passed_through_and_translated_read_as_its_own(
        engines: dict[str, Engine], gateways: dict[str, str]) -> None:
    """At every length from 1 to 16 tokens, streamed and whole. Passed through: llama-server's
    own /v1/messages answer. Translated: the text of the same chat's greedy answer through
    its /v1/chat/completions (the chat the gateway converts to), its stop reason and usage."""
    own = engines["llamacpp"].url
    conversation = CONVERSATIONS[1]
    messages = parse_messages(orjson.dumps({"max_tokens": 1, **conversation})).messages
    ended_inside_a_character = 0
    for max_tokens in range(1, 17):
        body = {"model": "tiny", "max_tokens": max_tokens, **GREEDY, **conversation}
        assert whole(gateways["llamacpp"], body) == whole(own, body)
        assert stream_events(gateways["llamacpp"], body) == stream_events(own, body)

        ask = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, **GREEDY}
        chat = httpx.post(own + "/v1/chat/completions", json=ask, timeout=60).json()
        text = chat["choices"][0]["message"]["content"]
        chat_stream = httpx.post(own + "/v1/chat/completions", json={**ask, "stream": True},
                                 timeout=60).content
        streamed_text = "".join(
            (orjson.loads(e[5:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            for e in chat_stream.split(b"\n\n") if e.startswith(b"data:") and b"[DONE]" not in e)
        ended_inside_a_character += text.endswith("\ufffd")
        reason = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
        sdk = client(gateways["llamacpp-chat"])
        message = sdk.messages.create(model="tiny", max_tokens=max_tokens, extra_body=GREEDY,
                                      **conversation)
        assert "".join(b.text for b in message.content if b.type == "text") == text, max_tokens
        assert message.stop_reason == reason, max_tokens
        assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
        # Anthropic's input_tokens leave out the part read from the engine's cache
        assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) \
            == chat["usage"]["prompt_tokens"]
        with sdk.messages.stream(model="tiny", max_tokens=max_tokens, extra_body=GREEDY,
                                 **conversation) as stream:
            final = stream.get_final_message()
        assert "".join(b.text for b in final.content if b.type == "text") == streamed_text
        assert final.stop_reason == reason
        assert final.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert ended_inside_a_character, "no answer ended inside a character: widen the lengths"


def test_the_conversion_is_vllm_s(tmp_path: Path) -> None:
    """The gateway's conversion of Messages requests to chat (what it counts and what it
    sends engines without the API) against vLLM's own ``to_chat_completion_request``."""
    requests = [{"model": "tiny", "max_tokens": 5, **c} for c in CONVERSATIONS] + [{
        "model": "tiny", "max_tokens": 5, "metadata": {"user_id": "u"},
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "Sys"}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Paris", "unit": "c"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "t2",
                 "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"type": "text", "text": "Thanks"}]},
            {"role": "system", "content": "inline"}]}]
    script = tmp_path / "convert.py"
    script.write_text(
        "import json, sys\n"
        "from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest\n"
        "from vllm.entrypoints.anthropic.serving import AnthropicServingMessages\n"
        "for line in sys.stdin:\n"
        "    request = AnthropicMessagesRequest.model_validate_json(line)\n"
        "    chat = AnthropicServingMessages.to_chat_completion_request(request)\n"
        "    tools = [t.model_dump(include={'type': True, 'function': {'name', 'description',"
        " 'parameters'}}) for t in chat.tools or []]\n"
        "    choice = chat.tool_choice if isinstance(chat.tool_choice, (str, type(None))) else "
        "chat.tool_choice.model_dump()\n"
        "    print(json.dumps({'messages': chat.messages, 'tools': tools or None, "
        "'tool_choice': choice}))\n")
    done = subprocess.run([str(vllm_python()), str(script)], capture_output=True, text=True,
                          input="\n".join(json.dumps(r) for r in requests), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(theirs) == len(requests)
    for request, vllm_chat in zip(requests, theirs):
        ours = parse_messages(orjson.dumps(request)).as_chat
        assert ours is not None
        assert ours["messages"] == vllm_chat["messages"], request
        assert ours.get("tools") == vllm_chat["tools"]
        if request.get("tool_choice"):
            assert ours["tool_choice"] == vllm_chat["tool_choice"]
