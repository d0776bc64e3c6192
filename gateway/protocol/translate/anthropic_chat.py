"""An Anthropic Messages client on an engine without the Messages API: sent as the OpenAI chat
it converts to (``gateway.protocol.anthropic``: what vLLM itself converts it to), answered in
Anthropic's shapes as vLLM writes them (``vllm/entrypoints/anthropic/serving.py``): the same
events in the same order, the same stop reasons, the same usage.

What a chat endpoint cannot carry exactly is refused by name (``refusal``): images, extended
thinking, cache-control hints, tool changes and references, output configuration, vLLM's own
fields. ``docs/translation.md`` has the table.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import orjson

from gateway.engines import Engine
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate.sse import ChunkReader
from gateway.protocol.translate.tgi_request import CannotHonour
from gateway.protocol.usage import Usage

# Request fields no chat completion carries (a vLLM-only field is vLLM's to honour).
UNTRANSLATABLE_FIELDS = ("thinking", "output_config", "cache_salt", "kv_transfer_params",
                         "ec_transfer_params", "vllm_xargs", "mm_payload", "return_mm_kwargs",
                         "watermarking")
UNTRANSLATABLE_BLOCKS = ("image", "thinking", "redacted_thinking", "tool_reference",
                         "tool_addition", "tool_removal")


def refusal(request: GenerationRequest, engine: Engine) -> CannotHonour | None:
    """Why ``engine``'s chat endpoint cannot serve this Messages request exactly (None: it
    can)."""
    body = request.body
    for name in UNTRANSLATABLE_FIELDS:
        if body.get(name) is not None:
            return _refused(f"`{name}`", name, engine)
    for where, block in _blocks(body):
        if block.get("type") in UNTRANSLATABLE_BLOCKS:
            return _refused(f"content blocks of type `{block['type']}`", where, engine)
        if "cache_control" in block:
            return _refused("`cache_control` hints", f"{where}.cache_control", engine)
    for i, tool in enumerate(body.get("tools") or ()):
        for key in ("cache_control", "defer_loading", "strict"):
            if tool.get(key) is not None:
                return _refused(f"`tools[{i}].{key}`", f"tools[{i}].{key}", engine)
        if tool.get("type") not in (None, "custom"):  # a server tool (web search ...)
            return _refused(f"tools of type `{tool['type']}`", f"tools[{i}].type", engine)
    if body.get("stop_sequences") and not engine.reports_matched_stop:
        # Its chat answer does not say whether a stop string or the end of turn stopped it.
        return _refused("`stop_sequences`", "stop_sequences", engine)
    return None


def _refused(what: str, param: str, engine: Engine) -> CannotHonour:
    return CannotHonour(f"{what} cannot be honoured by the {engine.name} replicas serving this "
                        f"model ({engine.title} has no Messages API; its chat completions have "
                        f"no equivalent)", param=param)


def _blocks(body: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every content block of the request, with where it is (nested tool results too)."""
    system = body.get("system")
    if isinstance(system, list):
        for j, block in enumerate(system):
            yield f"system[{j}]", block
    for i, message in enumerate(body.get("messages") or ()):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, block in enumerate(content):
            yield f"messages[{i}].content[{j}]", block
            inner = block.get("content")
            if block.get("type") == "tool_result" and isinstance(inner, list):
                for k, item in enumerate(inner):
                    if isinstance(item, dict):
                        yield f"messages[{i}].content[{j}].content[{k}]", item


def chat_body(request: GenerationRequest, model: str, output_cap: int | None) -> bytes:
    """The chat completion request sent to the engine."""
    assert request.as_chat is not None
    body = {**request.as_chat, "model": model}
    if output_cap is not None:
        body["max_tokens"] = output_cap
    return orjson.dumps(body)


def stop_reason(finish: str | None, matched: Any, tool_used: bool) -> tuple[str | None, Any]:
    """An OpenAI finish reason as Anthropic's ``(stop_reason, stop_sequence)``, as vLLM maps
    it: a matched stop string (a str) is a stop sequence; a stop token id or EOS ends the
    turn; a tool call ends in ``tool_use``."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage_json(usage: Any) -> dict[str, int]:
    """OpenAI usage as Anthropic's (vLLM's rule: ``input_tokens`` without the cached part)."""
    usage = usage if isinstance(usage, dict) else {}
    out = {"input_tokens": 0, "output_tokens": usage.get("completion_tokens") or 0}
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        prompt -= cached
        out["cache_read_input_tokens"] = cached
    out["input_tokens"] = max(0, prompt)
    return out


def _usage(usage: Any, finish: str | None) -> Usage:
    usage = usage if isinstance(usage, dict) else {}
    return Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), finish)


def message_body(chat: dict[str, Any], stop_key: str) -> tuple[bytes, Usage]:
    """A whole chat completion as an Anthropic message (vLLM's ``messages_full_converter``;
    None fields left out as vLLM leaves them)."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get(stop_key), bool(calls))
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": _arguments(function.get("arguments"))})
    out: dict[str, Any] = {"id": chat.get("id"), "type": "message", "role": "assistant",
                           "content": content or [{"type": "text", "text": ""}],
                           "model": chat.get("model")}
    if reason is not None:
        out["stop_reason"] = reason
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage_json(chat.get("usage"))
    return orjson.dumps(out), _usage(chat.get("usage"), reason)


def _arguments(text: Any) -> Any:
    """A tool call's arguments as its ``input``: {} when they do not parse (cut short by
    ``max_tokens``), as llama-server writes it; vLLM 0.32 answers that with a 400 of its
    JSON parser's words instead, which is no answer to a valid request."""
    try:
        parsed = orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _event(name: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageStream(ChunkReader):
    """Reads an engine's chat completion stream, writes Anthropic's events: ``message_start``
    (on the role chunk), a ``content_block_start`` / ``_delta`` / ``_stop`` run per text or
    tool-use block, ``message_delta`` with the stop reason and usage (on the usage chunk),
    ``message_stop`` (on ``[DONE]``; ``message_delta`` then too, with the last usage seen,
    when no usage chunk came). ``prompt_tokens``: the prompt's count for
    ``message_start`` when the engine reports none that early (None: 0, as vLLM writes it)."""

    def __init__(self, stop_key: str, prompt_tokens: Callable[[], int | None]) -> None:
        super().__init__()
        self.stop_key = stop_key
        self.prompt_tokens = prompt_tokens
        self.started = False
        self.block: str | None = None  # the open block's type
        self.index = 0  # the next block's index
        self.tool_id: str | None = None
        self.tool_ids: dict[int, str] = {}
        self.tool_used = False
        self.finish: str | None = None
        self.matched: Any = None
        self.delta_sent = False
        self.last_usage: Any = None

    def _done(self, out: list[bytes]) -> None:
        self._message_end(out, self.last_usage)
        out.append(_event(b"message_stop", {"type": "message_stop"}))
        self.finished = True

    def _error_event(self, message: str) -> bytes:
        return _event(b"error", {"type": "error", "error": {"type": "api_error",
                                                           "message": message}})

    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> int:
        if not self.started:
            self._message_start(chunk, out)
        if chunk.get("usage") is not None:  # an engine may put it on its last token chunk
            self.last_usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            if chunk.get("usage") is not None:  # the usage chunk: the message's end
                self._message_end(out, chunk["usage"])
            return 0
        return self._choice(choices[0], out)

    def _message_start(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        self.started = True
        usage = chunk.get("usage")
        start = usage_json(usage)
        if not isinstance(usage, dict):
            start["input_tokens"] = self.prompt_tokens() or 0
        out.append(_event(b"message_start", {"type": "message_start", "message": {
            "id": chunk.get("id"), "type": "message", "role": "assistant", "content": [],
            "model": chunk.get("model"), "stop_reason": None, "stop_sequence": None,
            "usage": start}}))

    def _choice(self, choice: dict[str, Any], out: list[bytes]) -> int:
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
            self.matched = choice.get(self.stop_key)
        delta = choice.get("delta") or {}
        tokens = 0
        text = delta.get("content")
        if text:
            if self.block != "text":
                self._stop_block(out)
                self._start_block(out, {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
            tokens = 1
        for call in delta.get("tool_calls") or ():
            tokens = 1
            function = call.get("function") or {}
            if call.get("id") is not None:
                self.tool_ids[call.get("index", 0)] = call["id"]
                if self.tool_id != call["id"] and function.get("name") is not None:
                    self._stop_block(out)
                    self.tool_used = True
                    self._start_block(out, {"type": "tool_use", "id": call["id"],
                                            "name": function["name"], "input": {}})
                    self.tool_id = call["id"]
            elif self.tool_ids.get(call.get("index", 0)) != self.tool_id:
                continue
            if function.get("arguments") and self.tool_id is not None:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": function["arguments"]}))
        return tokens

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event(b"content_block_delta", {"type": "content_block_delta",
                                               "index": self.index - 1, "delta": delta})

    def _start_block(self, out: list[bytes], block: dict[str, Any]) -> None:
        out.append(_event(b"content_block_start", {"type": "content_block_start",
                                                   "index": self.index, "content_block": block}))
        self.block = block["type"]
        self.index += 1

    def _stop_block(self, out: list[bytes]) -> None:
        if self.block is not None:
            out.append(_event(b"content_block_stop", {"type": "content_block_stop",
                                                      "index": self.index - 1}))
            self.block, self.tool_id = None, None

    def _message_end(self, out: list[bytes], usage: Any) -> None:
        """``message_delta`` once: on the usage chunk, or at ``[DONE]`` if none came."""
        if self.delta_sent:
            return
        self.delta_sent = True
        self._stop_block(out)
        reason, sequence = stop_reason(self.finish or "stop", self.matched, self.tool_used)
        self.usage = _usage(usage, reason)
        out.append(_event(b"message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": sequence}, "usage": usage_json(usage)}))
