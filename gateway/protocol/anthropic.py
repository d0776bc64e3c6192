"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) into a
GenerationRequest.

The request keeps the client's body (passed through to engines that serve the Messages API,
vLLM >= 0.32) and carries the same conversation as an OpenAI chat body (``as_chat``): what
vLLM itself turns it into (``vllm/entrypoints/anthropic/serving.py``,
``to_chat_completion_request``), so the window check and ``count_tokens`` count what vLLM
renders, and engines without the Messages API are sent that chat
(``gateway.protocol.translate.anthropic_chat``).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from gateway.protocol.errors import Api, InvalidRequest
from gateway.protocol.request import GenerationRequest, field, parse_json_object
from gateway.tokens import ChatTemplateError, ModelTokenizer

PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

# The content blocks vLLM 0.32 accepts in a message (its AnthropicContentBlock); any other
# type is refused by name, as vLLM refuses it.
BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference",
                         "thinking", "redacted_thinking", "tool_addition", "tool_removal"})
ROLES = ("user", "assistant", "system")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Claude Code's attribution line: vLLM drops it from the system prompt (a per-request hash
# that would defeat prefix caching); so does the conversion here, to count what vLLM renders.
BILLING_HEADER = "x-anthropic-billing-header"


def parse_messages(raw: bytes) -> GenerationRequest:
    body = parse_json_object(raw, Api.ANTHROPIC)
    max_tokens = field(body, "max_tokens", int, required=True, minimum=1)
    chat = _checked_chat(body)
    stream = bool(field(body, "stream", bool))
    stops = field(body, "stop_sequences", list)
    if stops is not None and not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("`stop_sequences` must be an array of strings",
                             param="stop_sequences")
    for name in ("temperature", "top_p"):
        field(body, name, float)
    field(body, "top_k", int, minimum=0)
    chat.update(max_tokens=max_tokens, stream=stream)
    for ours, theirs in (("stop_sequences", "stop"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if stream:
        chat["stream_options"] = {"include_usage": True}
    return GenerationRequest(api=Api.ANTHROPIC, path=PATH, body=body, raw=raw,
                             model=field(body, "model", str), stream=stream,
                             max_tokens=max_tokens, messages=chat["messages"],
                             wants_usage=stream, as_chat=chat)


def parse_count_tokens(raw: bytes) -> GenerationRequest:
    """No output: it costs its input, and the engine (or the gateway) only counts it."""
    body = parse_json_object(raw, Api.ANTHROPIC)
    chat = _checked_chat(body)
    return GenerationRequest(api=Api.ANTHROPIC, path=COUNT_TOKENS_PATH, body=body, raw=raw,
                             model=field(body, "model", str), stream=False, max_tokens=0,
                             messages=chat["messages"], pooling=True, as_chat=chat)


def prompt_tokens(request: GenerationRequest, tokenizer: ModelTokenizer) -> int:
    """The prompt's tokens as vLLM counts them: the chat the request converts to, rendered
    by the model's chat template with its generation prompt. Raises ChatTemplateError."""
    chat = request.as_chat or {}
    return tokenizer.count_chat(request.messages or [], tools=chat.get("tools"),
                                chat_template_kwargs=chat.get("chat_template_kwargs"))


def count_tokens(request: GenerationRequest, tokenizer: ModelTokenizer) -> bytes:
    """``count_tokens``'s answer, counted by the gateway."""
    try:
        count = prompt_tokens(request, tokenizer)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    return orjson.dumps({"input_tokens": count,
                         "context_management": {"original_input_tokens": count}})


def _checked_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The request's conversation as an OpenAI chat body (model, messages, tools, tool
    choice, user), its fields checked on the way."""
    messages = field(body, "messages", list, required=True)
    if not messages:
        raise InvalidRequest("`messages` must not be empty", param="messages")
    chat: dict[str, Any] = {}
    if body.get("model") is not None:
        chat["model"] = field(body, "model", str)
    chat["messages"] = out = _system(body.get("system"))
    for i, message in enumerate(messages):
        out += _message(message, f"messages[{i}]")
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    if tools is not None and "tool_choice" not in chat:
        chat["tool_choice"] = "auto"
    metadata = field(body, "metadata", dict)
    if metadata is not None and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]  # the session, for stickiness
    kwargs = field(body, "chat_template_kwargs", dict)
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise InvalidRequest(f"`{where}` must be a string or an array of content blocks",
                             param=where)
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise InvalidRequest(f"`{where}[{j}]` must be an object", param=where)
        kind = block.get("type")
        if kind not in BLOCK_TYPES:
            raise InvalidRequest(f"`{where}[{j}].type`: unknown content block type "
                                 f"{orjson.dumps(kind).decode()[:60]} (expected one of "
                                 f"{', '.join(sorted(BLOCK_TYPES))})", param=f"{where}[{j}].type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise InvalidRequest(f"`{where}[{j}].text` must be a string", param=where)
    return content


def _text_of(content: Any, where: str) -> str | None:
    """A system prompt's text (a string, or its text blocks joined), billing line dropped."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in _blocks(content, where)
             if b["type"] == "text" and b["text"] and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) or None


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text_of(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as the OpenAI messages it becomes (a user's tool results are
    messages of their own, role ``tool``, before it)."""
    if not isinstance(message, dict):
        raise InvalidRequest(f"`{where}` must be an object", param="messages")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"`{where}.role` must be one of {', '.join(ROLES)}",
                             param=f"{where}.role")
    content = message.get("content")
    if role == "system":
        text = _text_of(content, f"{where}.content")
        return [{"role": "system", "content": text}] if text else []
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in _blocks(content, f"{where}.content"):
        kind = block["type"]
        if kind == "text" and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or "", "type": "function", "function": {
                "name": block.get("name") or "",
                # Python's json.dumps, as vLLM writes the arguments (", " and ": ")
                "arguments": _python_json(block.get("input") or {})}})
        elif kind == "tool_result":
            result = block.get("content")
            if role == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                            "content": _tool_result_text(result)})
            else:
                parts.append({"type": "text", "text": f"Tool result: {result or ''}"})
    openai: dict[str, Any] = {"role": role}
    if reasoning:
        openai["reasoning"] = "".join(reasoning)
    if calls:
        openai["tool_calls"] = calls
    if parts:
        openai["content"] = (parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text"
                             else parts)
    if not (role == "user" and "content" not in openai):
        out.append(openai)
    return out


def _tool_result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, list):
        return "\n".join(str(item.get("text", "")) for item in result
                         if isinstance(item, dict) and item.get("type") == "text")
    return ""


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _python_json(value: Any) -> str:
    return json.dumps(value)  # the separators vLLM's json.dumps writes, not orjson's compact ones


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("`tools` must be an array", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"`tools[{i}]` must be an object", param="tools")
        name = field(tool, "name", str, required=True, where=f"tools[{i}].")
        schema = field(tool, "input_schema", dict, required=True, where=f"tools[{i}].")
        parameters = dict(schema)
        parameters.setdefault("type", "object")  # as vLLM defaults it (after the rest)
        out.append({"type": "function", "function": {
            "name": name, "description": tool.get("description"), "parameters": parameters}})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if not isinstance(choice, dict) or choice.get("type") not in (*TOOL_CHOICES, "tool"):
        raise InvalidRequest("`tool_choice.type` must be one of auto, any, tool, none",
                             param="tool_choice")
    out: dict[str, Any] = {"parallel_tool_calls": not choice.get("disable_parallel_tool_use")}
    if choice["type"] == "tool":
        name = field(choice, "name", str, required=True, where="tool_choice.")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = TOOL_CHOICES[choice["type"]]
    return out
