"""The simulated engine's Anthropic Messages API (``POST /v1/messages``, as vLLM >= 0.32 and
llama-server serve it): the request as the chat it asks for, answered in vLLM's events and
body (``vllm/entrypoints/anthropic/serving.py``). Text conversations only: a simulated
replica has no tool parser and no vision, so other content blocks are refused with a 400.
Its own code, not the gateway's: a misreading of the wire on either side shows."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.sim.dialects import ClientError
from gateway.sim.parse import Job
from gateway.sim.wire import openai_texts, request_id


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion a Messages request asks for (system first, text blocks joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError("messages: Field required", "schema")
    if not isinstance(body.get("max_tokens"), int):
        raise ClientError("max_tokens: Field required", "schema")
    chat: list[dict[str, str]] = []
    system = body.get("system")
    if system:
        chat.append({"role": "system", "content": _text(system)})
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ClientError("messages: each needs a role, user or assistant", "schema")
        chat.append({"role": message["role"], "content": _content(message.get("content"))})
    out: dict[str, Any] = {"messages": chat, "max_tokens": body["max_tokens"],
                           "stream": body.get("stream") is True}
    if body.get("model") is not None:
        out["model"] = body["model"]
    for theirs, ours in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stop_sequences", "stop")):
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def _text(content: Any) -> str:
    """A system prompt: its text blocks joined."""
    parts = _content(content)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def _content(content: Any) -> str | list[dict[str, str]]:
    """A message's content as vLLM passes it to the chat template: one text block as a
    string, several as text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(b, dict) and b.get("type") == "text" for b in content):
        parts = [{"type": "text", "text": str(b.get("text", ""))} for b in content]
        return parts[0]["text"] if len(parts) == 1 else parts
    raise ClientError("the simulated engine takes text content blocks only", "invalid")


def _stop(job: Job) -> tuple[str, str | None]:
    choice = job.choices[0]
    if choice.finish == "length":
        return "max_tokens", None
    if choice.finish == "stop" and choice.stop:
        return "stop_sequence", choice.stop
    return "end_turn", None


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


class MessageEvents:
    """One ``/v1/messages`` stream, event by event as vLLM writes them: ``message_start``,
    a text block's start, deltas and stop, ``message_delta`` with the stop reason and usage,
    ``message_stop``."""

    def __init__(self, model: str, job: Job) -> None:
        self.model, self.job = model, job
        self.texts = openai_texts(job.choices[0], trim_stop=True)
        self.id = request_id("chatcmpl-")
        self.started = False

    def open(self) -> bytes:
        return _event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.job.prompt_tokens, "output_tokens": 0}}})

    def tokens(self, start: int, pieces: list[int]) -> bytes:
        out = []
        for k in range(start, start + len(pieces)):
            text = self.texts[k] if k < len(self.texts) else ""
            if not text:
                continue
            if not self.started:
                self.started = True
                out.append(_event("content_block_start", {
                    "type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}))
            out.append(_event("content_block_delta", {
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}))
        return b"".join(out)

    def close(self, generated: int) -> bytes:
        reason, sequence = _stop(self.job)
        out = [_event("content_block_stop", {"type": "content_block_stop", "index": 0})
               if self.started else b""]
        out.append(_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": self.job.prompt_tokens, "output_tokens": generated}}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)


def message_body(model: str, job: Job) -> bytes:
    """A whole ``/v1/messages`` answer (vLLM leaves out fields that are None)."""
    reason, sequence = _stop(job)
    answer: dict[str, Any] = {
        "id": request_id("chatcmpl-"), "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": "".join(openai_texts(job.choices[0], True))}],
        "model": model, "stop_reason": reason}
    if sequence is not None:
        answer["stop_sequence"] = sequence
    answer["usage"] = {"input_tokens": job.prompt_tokens, "output_tokens": job.max_new}
    return orjson.dumps(answer)
