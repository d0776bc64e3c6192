"""Response bodies and SSE events of OpenAI-style and TGI generation routes.

Stream events are cut from templates once per response (``_split``) and filled with the
pre-encoded JSON of each word piece, so a token costs a few byte concatenations.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import orjson

from gateway.sim.textgen import PIECES, PIECES_JSON, text

_HOLE = "\x00"
_HOLE_JSON = b'"\\u0000"'
DONE = b"data: [DONE]\n\n"


def _split(obj: Any) -> list[bytes]:
    return orjson.dumps(obj).split(_HOLE_JSON)


def request_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def usage(prompt: int, completion: int) -> dict[str, int]:
    # vLLM's UsageInfo field order
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


class OpenAIStream:
    """The SSE events of one ``/v1/completions`` or ``/v1/chat/completions`` stream."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, n: int, finish_reason: str,
                 include_usage: bool, continuous_usage: bool, data_prefix: bytes = b"data: ") -> None:
        self.chat, self.model, self.prompt_tokens, self.n = chat, model, prompt_tokens, n
        self.include_usage, self.continuous = include_usage, continuous_usage
        self.prefix = data_prefix
        self.finish = orjson.dumps(finish_reason)
        self.id = request_id("chatcmpl-" if chat else "cmpl-")
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        choice: dict[str, Any] = ({"index": 0, "delta": {"content": _HOLE}, "logprobs": None,
                                   "finish_reason": _HOLE, "stop_reason": None} if chat else
                                  {"index": 0, "text": _HOLE, "logprobs": None,
                                   "finish_reason": _HOLE, "stop_reason": None})
        chunk: dict[str, Any] = {"id": self.id, "object": self.obj, "created": self.created,
                                 "model": model, "choices": [choice]}
        if continuous_usage:
            chunk["usage"] = _HOLE
        self.parts = _split(chunk)

    def _usage(self, completion: int) -> bytes:
        return orjson.dumps(usage(self.prompt_tokens, completion))

    def open(self) -> bytes:
        """vLLM's first chat chunk carries the role and no token."""
        if not self.chat:
            return b""
        chunk: dict[str, Any] = {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
        if self.continuous:
            chunk["usage"] = usage(self.prompt_tokens, 0)
        return self.prefix + orjson.dumps(chunk) + b"\n\n"

    def tokens(self, start: int, pieces: Sequence[int]) -> bytes:
        """Events for tokens ``start .. start+len(pieces)-1`` (one event per token)."""
        p0, p1, p2 = self.parts[0], self.parts[1], self.parts[2]
        head, last = self.prefix + p0, self.n - 1
        out = []
        for k, j in enumerate(pieces, start):
            fin = self.finish if k == last else b"null"
            if self.continuous:
                out.append(head + PIECES_JSON[j] + p1 + fin + p2 + self._usage(k + 1) + self.parts[3] + b"\n\n")
            else:
                out.append(head + PIECES_JSON[j] + p1 + fin + p2 + b"\n\n")
        return b"".join(out)

    def close(self, generated: int) -> bytes:
        if not self.include_usage:
            return self.prefix + b"[DONE]\n\n"
        chunk = {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                 "choices": [], "usage": usage(self.prompt_tokens, generated)}
        return self.prefix + orjson.dumps(chunk) + b"\n\n" + self.prefix + b"[DONE]\n\n"


def openai_body(chat: bool, model: str, prompt_tokens: int, pieces: Sequence[int],
                finish_reason: str) -> bytes:
    content = text(pieces)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": []},
                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        rid, obj = request_id("chatcmpl-"), "chat.completion"
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
        rid, obj = request_id("cmpl-"), "text_completion"
    return orjson.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                         "choices": [choice], "usage": usage(prompt_tokens, len(pieces))})


class TGIStream:
    """``/generate_stream`` events: one per token; the last one carries ``generated_text``."""

    LOGPROB = b"-0.1"

    def __init__(self, ids: Sequence[int], prompt_tokens: int, n: int, finish_reason: str,
                 seed: int | None, details: bool, data_prefix: bytes = b"data: ") -> None:
        self.ids, self.prompt_tokens, self.n = ids, prompt_tokens, n
        self.finish_reason, self.seed, self.details = finish_reason, seed, details
        self.prefix = data_prefix
        self.pieces: list[int] = []

    def open(self) -> bytes:
        return b""

    def _token(self, j: int) -> bytes:
        return b'{"id":%d,"text":%s,"logprob":%s,"special":false}' % (self.ids[j], PIECES_JSON[j], self.LOGPROB)

    def tokens(self, start: int, pieces: Sequence[int]) -> bytes:
        self.pieces.extend(pieces)
        out = []
        for k, j in enumerate(pieces, start):
            if k < self.n - 1:
                out.append(b'%s{"index":%d,"token":%s,"generated_text":null,"details":null}\n\n'
                           % (self.prefix, k + 1, self._token(j)))
            else:
                details = orjson.dumps({"finish_reason": self.finish_reason, "generated_tokens": self.n,
                                        "seed": self.seed, "input_length": self.prompt_tokens}) \
                    if self.details else b"null"
                out.append(b'%s{"index":%d,"token":%s,"generated_text":%s,"details":%s}\n\n'
                           % (self.prefix, k + 1, self._token(j), orjson.dumps(text(self.pieces)), details))
        return b"".join(out)

    def close(self, generated: int) -> bytes:
        return b""  # no [DONE] on /generate_stream


def tgi_output(ids: Sequence[int], pieces: Sequence[int], finish_reason: str, seed: int | None,
               details: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"generated_text": text(pieces)}
    if details:
        out["details"] = {
            "finish_reason": finish_reason, "generated_tokens": len(pieces), "seed": seed, "prefill": [],
            "tokens": [{"id": ids[j], "text": PIECES[j], "logprob": -0.1, "special": False} for j in pieces],
        }
    return out
