"""Bad input becomes a 4xx naming the field, in each protocol's shape."""

from __future__ import annotations

import orjson
import pytest

from gateway.protocol.errors import Api, InvalidRequest, error_from_engine
from gateway.protocol.openai import parse_chat, parse_completion
from gateway.protocol.tgi import parse_generate


@pytest.mark.parametrize("raw, field", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b"", None),
    (b'{"model": "m"}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"content": "x"}]}', "role"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": 5}', "model"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
    (b"[" * 200 + b"]" * 200, None),
])
def test_openai_chat_rejects_bad_input_naming_the_field(raw: bytes, field: str | None) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_chat(raw)
    assert err.value.status_for(Api.OPENAI) == 400
    body = err.value.openai_body()["error"]
    assert body["type"] == "invalid_request_error"
    if field:
        assert field in body["message"]


@pytest.mark.parametrize("raw", [b'{"prompt": 5}', b'{"prompt": []}', b'{"prompt": [1, "a"]}',
                                 b'{"prompt": [true]}', b'{}', b'{"prompt": [-1]}'])
def test_openai_completion_rejects_bad_prompts(raw: bytes) -> None:
    with pytest.raises(InvalidRequest, match="prompt"):
        parse_completion(raw)


@pytest.mark.parametrize("raw, fragment", [
    (b'{"parameters": {}}', "inputs"),
    (b'{"inputs": ""}', "cannot be empty"),
    (b'{"inputs": "x", "parameters": {"max_new_tokens": 0}}', "strictly positive"),
    (b'{"inputs": "x", "parameters": {"max_new_tokens": "a"}}', "max_new_tokens"),
    (b'{"inputs": "x", "parameters": []}', "parameters"),
])
def test_tgi_rejects_bad_input_with_validation_422(raw: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_generate(raw, stream=False)
    assert err.value.status_for(Api.TGI) == 422
    assert err.value.tgi_body()["error_type"] == "validation"
    assert fragment in err.value.tgi_body()["error"]


def test_valid_requests_parse() -> None:
    chat = parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                      b'"max_completion_tokens": 7, "max_tokens": 3, "stream": true, '
                      b'"stream_options": {"include_usage": true}}')
    assert (chat.max_tokens, chat.stream, chat.wants_usage, chat.path) == (7, True, True, "/v1/chat/completions")
    compat = parse_generate(b'{"inputs": "x", "stream": true}', stream=None)
    assert (compat.stream, compat.path) == (True, "/")


@pytest.mark.parametrize("status, body, code", [
    (400, {"error": {"message": "This model's maximum context length is 10 tokens. However, your request has 20 input tokens.", "type": "BadRequestError", "param": None, "code": 400}}, "context_length_exceeded"),
    (400, {"object": "error", "message": "This model's maximum context length is 10 tokens.", "type": "BadRequestError", "param": None, "code": 400}, "context_length_exceeded"),
    (400, {"error": {"code": 400, "message": "request (36017 tokens) exceeds the available context size (32768 tokens), try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 36017, "n_ctx": 32768}}, "context_length_exceeded"),
    (422, {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 10. Given: 8 `inputs` tokens and 5 `max_new_tokens`", "error_type": "validation"}, "context_length_exceeded"),
    (429, {"error": "Model is overloaded", "error_type": "overloaded"}, None),
    (500, {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}, None),
])
def test_engine_errors_are_read_in_every_dialect(status: int, body: dict, code: str | None) -> None:
    error = error_from_engine(status, orjson.dumps(body))
    assert error.code == code
    assert error.message and "{" not in error.message[:1]
    if code:
        assert error.status == 400
        assert error.tgi_body()["error_type"] == "validation"
    if status == 429:
        assert error.tgi_body() == {"error": "Model is overloaded", "error_type": "overloaded"}


def test_non_json_engine_error_keeps_status() -> None:
    error = error_from_engine(502, b"<html>bad gateway</html>")
    assert error.status == 502 and "bad gateway" in error.message


def test_wrong_type_message_cuts_a_long_value_without_breaking_utf8() -> None:
    """The message quotes at most 80 bytes of the value; a cut inside a multi-byte
    character must not turn a 400 into a 500 (found by fuzzing)."""
    from gateway.protocol.errors import InvalidRequest
    from gateway.protocol.tgi import parse_generate

    body = ('{"inputs": "x", "parameters": {"details": "' + "é" * 60 + '"}}').encode()
    with pytest.raises(InvalidRequest) as error:
        parse_generate(body, stream=False)
    assert "details" in error.value.message
