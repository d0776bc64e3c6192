"""Anthropic's wire, byte level: a chat stream translated into Messages events (text, tool
use, stop strings, an engine error, cut at every byte), a whole chat answer as a message, the
pass-through reader's usage and token count on vLLM's and llama.cpp's own events, and the
error shapes. The tool-use events are checked against Anthropic's documented example (API
reference, "Streaming messages": a text block, then a ``tool_use`` block whose input comes
as ``input_json_delta`` pieces, then ``message_delta`` with ``stop_reason: tool_use``)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.protocol.anthropic import parse_count_tokens, parse_messages
from gateway.protocol.errors import Api, ContextLengthExceeded, InvalidRequest, Overloaded
from gateway.protocol.translate.anthropic_chat import MessageStream, message_body
from gateway.protocol.translate.passthrough import EventReader


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                         **choice}]}


USAGE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [], "usage": {"prompt_tokens": 21, "completion_tokens": 9,
                                  "total_tokens": 30}}
# vLLM's chat stream for "What is the weather in Paris?" answered with text, then a call.
TOOL_STREAM = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Let me check"}),
    chunk({"content": "."}),
    chunk({"tool_calls": [{"id": "chatcmpl-tool-9", "type": "function", "index": 0,
                           "function": {"name": "get_weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"location": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chunk({}, "tool_calls", stop_reason=None),
    USAGE)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in raw.split(b"\n\n"):
        if event:
            name, _, data = event.partition(b"\ndata: ")
            out.append((name.removeprefix(b"event: ").decode(), orjson.loads(data)))
    return out


def translate(raw: bytes, cuts: int = 1, prompt: int | None = 21) -> tuple[bytes, MessageStream]:
    stream = MessageStream("stop_reason", lambda: prompt)
    out = b""
    step = max(1, len(raw) // cuts)
    for at in range(0, len(raw), step):
        out += stream.feed(raw[at:at + step])[0]
    return out + stream.pending, stream


def test_text_then_tool_use_as_anthropic_documents_it() -> None:
    out, stream = translate(TOOL_STREAM)
    got = events(out)
    assert [name for name, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in got)
    assert got[0][1]["message"] == {
        "id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [],
        "model": "m", "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 21, "output_tokens": 0}}
    assert got[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert [d["delta"] for _, d in got[2:4]] == [{"type": "text_delta", "text": "Let me check"},
                                                 {"type": "text_delta", "text": "."}]
    assert got[5][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "chatcmpl-tool-9", "name": "get_weather", "input": {}}}
    pieces = [d["delta"] for _, d in got[6:8]]
    assert all(p["type"] == "input_json_delta" for p in pieces)
    assert orjson.loads("".join(p["partial_json"] for p in pieces)) == {"location": "Paris"}
    assert [d["index"] for _, d in got[1:9]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert got[9][1] == {"type": "message_delta",
                         "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                         "usage": {"input_tokens": 21, "output_tokens": 9}}
    assert stream.finished and stream.token_events == 5
    assert (stream.usage.prompt_tokens, stream.usage.completion_tokens) == (21, 9)
    assert stream.usage.finish_reason == "tool_use"


@pytest.mark.parametrize("cuts", [2, 3, 7, 50, len(TOOL_STREAM)])
def test_a_stream_read_in_any_pieces_translates_the_same(cuts: int) -> None:
    assert translate(TOOL_STREAM, cuts)[0] == translate(TOOL_STREAM)[0]


@pytest.mark.parametrize("finish, matched, reason, sequence", [
    ("stop", "END", "stop_sequence", "END"),  # a stop string matched
    ("stop", 2, "end_turn", None),  # a stop token id
    ("stop", None, "end_turn", None),  # EOS
    ("length", None, "max_tokens", None),
])
def test_stop_reasons(finish: str, matched: Any, reason: str, sequence: str | None) -> None:
    raw = sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "hi"}),
              chunk({}, finish, stop_reason=matched), USAGE)
    delta = [d for n, d in events(translate(raw)[0]) if n == "message_delta"]
    assert delta == [{"type": "message_delta",
                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": {"input_tokens": 21, "output_tokens": 9}}]


def test_an_engine_without_a_usage_chunk_and_an_engine_error() -> None:
    """No usage chunk: ``message_delta`` at ``[DONE]`` (zeros, as vLLM writes a missing
    usage); ``message_start`` counts the prompt the gateway rendered. An error event ends
    the stream as Anthropic's ``error`` event."""
    raw = sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "a"}, "length"))
    got = events(translate(raw, prompt=7)[0])
    assert got[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert [n for n, _ in got][-2:] == ["message_delta", "message_stop"]
    broken = (b"data: " + orjson.dumps(chunk({"role": "assistant", "content": ""})) + b"\n\n"
              + b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
    out, stream = translate(broken)
    assert events(out)[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "engine died"}})
    assert stream.finished


def test_a_whole_answer_as_a_message() -> None:
    answer = {"id": "chatcmpl-2", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": {
            "role": "assistant", "content": "Checking.", "tool_calls": [{
                "id": "call-1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"location": "Paris"}'}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
                  "prompt_tokens_details": {"cached_tokens": 16}}}
    body, usage = message_body(answer, "stop_reason")
    assert orjson.loads(body) == {
        "id": "chatcmpl-2", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call-1", "name": "get_weather",
                     "input": {"location": "Paris"}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 14, "output_tokens": 12, "cache_read_input_tokens": 16}}
    assert (usage.prompt_tokens, usage.completion_tokens) == (30, 12)
    cut = {**answer, "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "tool_calls": [{"id": "call-2", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"loca'}}]}}]}
    assert orjson.loads(message_body(cut, "stop_reason")[0])["content"] == [
        {"type": "tool_use", "id": "call-2", "name": "get_weather", "input": {}}]
    empty = {**answer, "choices": [{"index": 0, "finish_reason": "length",
                                    "message": {"role": "assistant", "content": ""}}]}
    assert orjson.loads(message_body(empty, "stop_reason")[0])["content"] == [
        {"type": "text", "text": ""}]


# vLLM 0.32's own /v1/messages stream (its serving.py, model_dump_json: compact JSON), and
# llama-server's (usage: input in message_start, output only in message_delta).
VLLM_EVENTS = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-3",'
    b'"type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":11,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
    b'{"type":"text_delta","text":"event: message_stop\\n"}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
    b'{"type":"text_delta","text":"\xc3\xa9"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens",'
    b'"stop_sequence":null},"usage":{"input_tokens":11,"output_tokens":2}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
LLAMA_DELTA = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
               b'"end_turn","stop_sequence":null},"usage":{"output_tokens":2}}\n\n')


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_passed_through_events_are_read_not_changed(engine: str) -> None:
    raw = VLLM_EVENTS
    if engine == "llamacpp":
        start = raw.index(b"event: message_delta")
        raw = raw[:start] + LLAMA_DELTA + raw[raw.rindex(b"event: message_stop"):]
    for size in (len(raw), 40, 7, 1):
        reader = EventReader(Api.ANTHROPIC, strip_usage=False)
        out, tokens, ended_early = b"", 0, False
        for at in range(0, len(raw), size):
            piece, n = reader.feed(raw[at:at + size])
            out, tokens = out + piece, tokens + n
            ended_early |= reader.finished and at + size < len(raw) - 40
        assert out + reader.pending == raw and tokens == reader.token_events == 2
        assert not ended_early  # "event: message_stop" in a token's text ends nothing
        assert reader.finished
        assert (reader.usage.prompt_tokens, reader.usage.completion_tokens) == (11, 2)
        assert reader.usage.finish_reason == ("max_tokens" if engine == "vllm" else "end_turn")


def test_errors_in_anthropic_s_shape() -> None:
    error = InvalidRequest("`max_tokens` is required", param="max_tokens")
    assert orjson.loads(error.body(Api.ANTHROPIC)) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "`max_tokens` is required"}}
    assert error.status_for(Api.ANTHROPIC) == 400
    assert orjson.loads(Overloaded("busy").body(Api.ANTHROPIC))["error"]["type"] == \
        "rate_limit_error"
    assert ContextLengthExceeded(10, 8, 4, Api.ANTHROPIC).status_for(Api.ANTHROPIC) == 400
    event = error.sse_event(Api.ANTHROPIC)
    assert event.startswith(b"event: error\ndata: {") and event.endswith(b"}\n\n")


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": 4}, "`messages` is required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "at least 1"),
    ({"max_tokens": 4, "messages": []}, "must not be empty"),
    ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 3}]}, "content blocks"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "text` must be a string"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [1]},
     "stop_sequences"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f"}]}, "input_schema"),
])
def test_bad_requests_are_named(body: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_messages(orjson.dumps(body))


def test_the_conversation_converts_as_vllm_converts_it() -> None:
    """System first (text blocks joined, Claude Code's billing line dropped), tool results as
    ``tool`` messages before the user's text, tool calls with their input as JSON, the
    session from ``metadata.user_id``. (tests/real_engines/test_real_anthropic.py compares
    with vLLM's own conversion.)"""
    request = parse_messages(orjson.dumps({
        "model": "m", "max_tokens": 5, "metadata": {"user_id": "u-1"}, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "Be brief."}],
        "tools": [{"name": "get_weather", "input_schema": {"properties": {}}}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                               "name": "get_weather", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "sunny"}]},
                                         {"type": "text", "text": "Thanks"}]}]}))
    assert request.api is Api.ANTHROPIC and request.stream and request.max_tokens == 5
    chat = request.as_chat
    assert chat is not None and chat["messages"] == request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "Thanks"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": None,
        "parameters": {"properties": {}, "type": "object"}}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is True
    assert chat["user"] == "u-1" and chat["stream_options"] == {"include_usage": True}
    counted = parse_count_tokens(orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": "x"}]}))
    assert counted.pooling and counted.max_tokens == 0 and counted.messages == [
        {"role": "user", "content": "x"}]
