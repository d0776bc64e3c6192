"""The Responses API, passed through: its stream is not chat's. Events are
``event: response.…\\ndata: {...}\\n\\n`` with no ``[DONE]``; the stream ends with
``response.completed`` (or ``.failed`` / ``.incomplete``, or an ``error`` event); tokens come
as ``response.*.delta`` events; usage (``input_tokens``, ``output_tokens``) and the stored
response's id are in the ``response`` object of the first and last events. Only those two
events are parsed; deltas are counted from the bytes.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import orjson

from gateway.protocol.translate.passthrough import PassThrough
from gateway.protocol.usage import Usage

_DELTA = re.compile(rb'"type":"response\.[a-z_.]+\.delta"')
_READ = re.compile(rb'"type":"(response\.created|response\.completed|response\.failed'
                   rb'|response\.incomplete|error)"')


def _usage(response: Any, usage: Usage) -> Usage:
    """``usage`` updated from a Response object (its id, and its counts once it has them)."""
    if not isinstance(response, dict):
        return usage
    if isinstance(response.get("id"), str) and response.get("store", True) is not False:
        usage.stored_id = response["id"]
    counts = response.get("usage")
    if isinstance(counts, dict):
        usage.prompt_tokens = counts.get("input_tokens")
        usage.completion_tokens = counts.get("output_tokens")
    return usage


def _payloads(events: bytes) -> list[bytes]:
    return [line[5:].strip() for line in events.split(b"\n") if line.startswith(b"data:")]


class ResponsesStream:
    """Splits upstream bytes on SSE event boundaries, counts delta events as tokens, reads
    the id and usage from the created and final events."""

    __slots__ = ("partial", "usage", "token_events", "finished")

    def __init__(self) -> None:
        self.partial = b""
        self.usage = Usage()
        self.token_events = 0
        self.finished = False

    @property
    def pending(self) -> bytes:
        return self.partial

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        data = self.partial + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.partial = data
            return b"", 0
        out, self.partial = data[:cut + 2], data[cut + 2:]
        tokens = 0
        for payload in _payloads(out):
            if _DELTA.search(payload):
                tokens += 1
            elif _READ.search(payload):  # the first and the last event: parsed
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(event, dict):
                    continue
                self.usage = _usage(event.get("response"), self.usage)
                if event.get("type") != "response.created":
                    self.finished = True
        self.token_events += tokens
        return out, tokens


class ResponsesPassThrough(PassThrough):
    """``gateway.protocol.translate.Translation`` for /v1/responses: the body as it came
    (a Responses stream always ends with its usage), its own stream reader and usage."""

    __slots__ = ()

    @property
    def body(self) -> bytes:
        if self.output_cap is None:
            return self.request.raw
        return orjson.dumps({**self.request.body, "max_output_tokens": self.output_cap})

    def reader(self) -> ResponsesStream:
        return ResponsesStream()

    def response(self, content: bytes, headers: Mapping[str, str]
                 ) -> tuple[bytes, Usage, list[tuple[bytes, bytes]]]:
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = None
        return content, _usage(parsed, Usage()), []
