"""A broken stream's continuation: what the next replica is sent, and how its answer joins
the stream the client already has.

The next replica gets ``/v1/completions`` (``PATH``) with the prompt's ids and the ids
generated so far as its prompt, the sampling parameters of what the first replica was sent,
and the tokens still allowed: ``max_tokens`` less those generated (``body``). Its events are
then made the first replica's (``splice``), before anything reads them: the first replica's
``id`` and ``created``; no second ``prompt_token_ids``; usage that counts the prompt once and
every generated token once; and for a chat client, vLLM's chat chunks built from the
completion chunks (the same text, token ids, finish and stop reasons). So the reader that
was reading the first replica's stream reads on, and what it writes the client continues
where it stopped: OpenAI chunks, or a TGI client's token events with their indices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from gateway.protocol.translate.sse import payloads

PATH = "/v1/completions"
VLLM_COMPLETIONS_MAX_TOKENS = 16  # vLLM's default for /v1/completions without max_tokens

# A chat body's fields that only shape the prompt (rendered into its ids already) or the
# form of a chat answer; refused ones (exactness.py) are listed too, never copied.
_CHAT_ONLY = frozenset({
    "messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
    "documents", "mm_processor_kwargs", "echo", "add_special_tokens", "reasoning_effort",
    "include_reasoning", "response_format", "logprobs", "top_logprobs", "functions",
    "function_call", "user", "metadata", "store", "modalities", "prediction", "service_tier"})
# What the continuation says itself, or must not say again.
_RESET = frozenset({"prompt", "max_tokens", "echo", "truncate_prompt_tokens", "prompt_logprobs",
                    "n", "best_of", "suffix", "kv_transfer_params", "request_id", "stream",
                    "stream_options", "return_token_ids"})
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[[0-9, ]*\]')
_HEAD = re.compile(rb'\{"id":"[^"]*","object":"[^"]*","created":\d+,')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\d+')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(frozen=True, slots=True)
class Origin:
    """What the client's stream says of itself: its first event's id, object, time, model."""

    id: str
    object: str
    created: int
    model: str

    @classmethod
    def of(cls, head: bytes) -> "Origin":
        """From the stream's first event, as the engine sent it (``ValueError``: not one)."""
        try:
            event = orjson.loads(head.partition(b"data:")[2])
            return cls(event["id"], event["object"], event["created"], event["model"])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"the stream's first event is not an OpenAI chunk: {exc}") from None

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage chunk the engine ends with, as vLLM writes it."""
        return b"data: " + orjson.dumps({
            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens,
                                     "completion_tokens": completion_tokens}}) + b"\n\n"


def tokens_left(sent: dict[str, Any], chat: bool, prompt_tokens: int, generated: int,
                window: int | None) -> int | None:
    """How many tokens the continuation may still generate: what the first replica was
    allowed (its ``max_tokens``, or vLLM's default: 16 for a completion, the rest of the
    window for a chat), less ``generated``. None: unknown (a chat with no ``max_tokens`` on
    a replica whose window is unknown)."""
    asked = (sent.get("max_completion_tokens") or sent.get("max_tokens")) if chat \
        else sent.get("max_tokens", VLLM_COMPLETIONS_MAX_TOKENS)
    room = None if window is None else window - prompt_tokens  # vLLM cuts max_tokens to fit
    if not isinstance(asked, int) or isinstance(asked, bool):
        asked = None
    allowed = room if asked is None else asked if room is None else min(asked, room)
    return None if allowed is None else allowed - generated


def body(sent: dict[str, Any], chat: bool, ids: list[int], generated: int, left: int) -> bytes:
    """The continuation's ``/v1/completions`` body: ``ids`` (the prompt's and the
    ``generated`` ones') as its prompt, ``left`` tokens at most, the sampling parameters of
    ``sent`` (the body the first replica got), token ids and usage asked for."""
    fields = {k: v for k, v in sent.items() if k not in _RESET and not (chat and k in _CHAT_ONLY)}
    minimum = fields.get("min_tokens")
    if isinstance(minimum, int) and not isinstance(minimum, bool):
        fields["min_tokens"] = max(0, minimum - generated)
    fields.update(prompt=ids, max_tokens=left, stream=True,
                  stream_options={"include_usage": True}, return_token_ids=True)
    return orjson.dumps(fields)


def splice(origin: Origin, chat: bool, prompt_tokens: int,
           carried: int) -> Callable[[bytes], bytes]:
    """What makes a continuation's events (whole ones) the first replica's; ``carried``:
    the tokens its prompt ends with (generated before it)."""
    return ChatSplice(origin, prompt_tokens, carried) if chat \
        else CompletionSplice(origin, prompt_tokens, carried)


class CompletionSplice:
    """A continuation of a ``/v1/completions`` stream (a completion client's, or a TGI
    client's on vLLM): the same events, renamed and recounted, bytes otherwise untouched."""

    __slots__ = ("head", "prompt_tokens", "carried", "rename")

    def __init__(self, origin: Origin, prompt_tokens: int, carried: int) -> None:
        self.head = orjson.dumps({"id": origin.id, "object": origin.object,
                                  "created": origin.created})[:-1] + b","
        self.prompt_tokens, self.carried = prompt_tokens, carried
        self.rename: bytes | None = None  # the continuation's own head, once seen

    def __call__(self, chunk: bytes) -> bytes:
        if self.rename is None:
            match = _HEAD.search(chunk)
            if match is not None:
                self.rename = match.group(0)
        if self.rename is not None:
            chunk = chunk.replace(self.rename, self.head)
        if b'"prompt_token_ids":[' in chunk:  # the prompt it was given: the client's and more
            chunk = _PROMPT_IDS.sub(b'"prompt_token_ids":null', chunk)
        if b'"usage":{' in chunk:
            chunk = _PROMPT_TOKENS.sub(b'"prompt_tokens":%d' % self.prompt_tokens, chunk)
            chunk = _COMPLETION_TOKENS.sub(self._completion, chunk)
        return chunk

    def _completion(self, match: re.Match[bytes]) -> bytes:
        return b'"completion_tokens":%d' % (int(match.group(1)) + self.carried)


class ChatSplice:
    """A continuation of a chat stream: each completion chunk as the chat chunk vLLM writes
    for the same output (``delta.content``; ``stop_reason`` with the finish; ``token_ids``)."""

    __slots__ = ("origin", "prompt_tokens", "carried")

    def __init__(self, origin: Origin, prompt_tokens: int, carried: int) -> None:
        self.origin, self.prompt_tokens, self.carried = origin, prompt_tokens, carried

    def __call__(self, chunk: bytes) -> bytes:
        out = []
        for payload in payloads(chunk):
            if not payload.startswith(b"{"):  # [DONE]
                out.append(b"data: " + payload + b"\n\n")
                continue
            event = orjson.loads(payload)
            if "error" in event:  # the continuation broke too: the log reads it
                out.append(b"data: " + payload + b"\n\n")
                continue
            out.append(b"data: " + orjson.dumps(self._chat(event)) + b"\n\n")
        return b"".join(out)

    def _chat(self, event: dict[str, Any]) -> dict[str, Any]:
        o = self.origin
        chat: dict[str, Any] = {"id": o.id, "object": o.object, "created": o.created,
                                "model": o.model, "choices": []}
        for c in event.get("choices") or ():
            choice = {"index": c.get("index", 0), "delta": {"content": c.get("text") or ""},
                      "logprobs": None, "finish_reason": c.get("finish_reason")}
            if c.get("finish_reason") is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = c.get("token_ids")
            chat["choices"].append(choice)
        usage = event.get("usage")
        if isinstance(usage, dict):
            completion = (usage.get("completion_tokens") or 0) + self.carried
            chat["usage"] = {**usage, "prompt_tokens": self.prompt_tokens,
                             "total_tokens": self.prompt_tokens + completion,
                             "completion_tokens": completion}
        if "system_fingerprint" in event:
            chat["system_fingerprint"] = event["system_fingerprint"]
        return chat
