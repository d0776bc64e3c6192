"""OpenAI-style requests (/v1/completions, /v1/chat/completions) into GenerationRequest."""

from __future__ import annotations

from typing import Any

from gateway.protocol.errors import Api, InvalidRequest
from gateway.protocol.request import GenerationRequest, field, parse_json_object


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(field(body, "stream", bool))
    options = field(body, "stream_options", dict)
    wants_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest("Stream options can only be defined when `stream=True`.",
                                 param="stream_options")
        wants_usage = bool(field(options, "include_usage", bool, where="stream_options."))
    return stream, wants_usage


def check_prompt(prompt: Any, name: str = "prompt") -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in p) for p in prompt):
            return
    raise InvalidRequest(f"`{name}` must be a string, an array of strings, an array of token ids "
                         "or an array of arrays of token ids (non-empty)", param=name)


def check_messages(messages: list[Any]) -> None:
    if not messages:
        raise InvalidRequest("`messages` must not be empty", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(message, dict):
            raise InvalidRequest(f"`messages[{i}]` must be an object", param="messages")
        field(message, "role", str, required=True, where=where)
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"`{where}content` must be a string or an array of parts",
                                 param="messages")


def _common(body: dict[str, Any], raw: bytes, path: str, max_tokens: int | None,
            **kwargs: Any) -> GenerationRequest:
    stream, wants_usage = _stream_fields(body)
    return GenerationRequest(
        api=Api.OPENAI, path=path, body=body, raw=raw, model=field(body, "model", str),
        stream=stream, max_tokens=max_tokens, wants_usage=wants_usage,
        choices=field(body, "n", int, minimum=1) or 1, **kwargs)


def parse_completion(raw: bytes) -> GenerationRequest:
    body = parse_json_object(raw, Api.OPENAI)
    if "prompt" not in body:
        raise InvalidRequest("`prompt` is required", param="prompt")
    check_prompt(body["prompt"])
    return _common(body, raw, "/v1/completions", field(body, "max_tokens", int, minimum=1),
                   prompt=body["prompt"])


def parse_chat(raw: bytes) -> GenerationRequest:
    body = parse_json_object(raw, Api.OPENAI)
    messages = field(body, "messages", list, required=True)
    check_messages(messages)
    # vLLM: max_completion_tokens wins over the deprecated max_tokens.
    max_tokens = (field(body, "max_completion_tokens", int, minimum=1)
                  or field(body, "max_tokens", int, minimum=1))
    return _common(body, raw, "/v1/chat/completions", max_tokens, messages=messages)
