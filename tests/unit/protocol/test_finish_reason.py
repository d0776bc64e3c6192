"""The finish reason each answer's usage carries (for the access log and traces), as the
client was told it."""

from __future__ import annotations

import orjson

from gateway.protocol.errors import Api
from gateway.protocol.translate.passthrough import EventReader, usage_of


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n"
                    for p in payloads)


def test_openai_stream_reason_read_off_the_bytes_whether_usage_is_stripped_or_not() -> None:
    chunk = {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    last = {"id": "c", "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    for strip in (True, False):
        reader = EventReader(Api.OPENAI, strip_usage=strip)
        for part in (sse(chunk), sse(last), sse(usage, b"[DONE]")):
            reader.feed(part)
        assert (reader.usage.prompt_tokens, reader.usage.completion_tokens,
                reader.usage.finish_reason) == (3, 2, "length")


def test_tgi_stream_and_whole_answers() -> None:
    reader = EventReader(Api.TGI, strip_usage=False)
    reader.feed(sse({"token": {"id": 1, "text": "a"}, "generated_text": None, "details": None},
                    {"token": {"id": 2, "text": "b"}, "generated_text": "ab",
                     "details": {"finish_reason": "eos_token", "generated_tokens": 2,
                                 "input_length": 4}}))
    assert reader.usage.finish_reason == "eos_token"
    assert usage_of({"choices": [{"finish_reason": "stop"}], "usage": {
        "prompt_tokens": 1, "completion_tokens": 1}}, Api.OPENAI).finish_reason == "stop"
    assert usage_of({"details": {"finish_reason": "length"}}, Api.TGI).finish_reason == "length"
    assert usage_of({"choices": [{"finish_reason": 5}]}, Api.OPENAI).finish_reason is None
