"""Same-dialect traffic: the client's request goes to the engine as it came, the engine's
answer back as it came. The one change on the way up is a request for the usage chunk of
an OpenAI stream (token truth), which comes off again on the way down when the client did
not ask for it.

Streams are read as bytes, never parsed per event: each upstream read is split on SSE event
boundaries and scanned for what the gateway needs (token events, the usage chunk, TGI's
final details, an error event); only the event that carries usage or details is parsed,
once per stream.
"""

from __future__ import annotations

from typing import Any, Mapping

import orjson

from gateway.protocol.errors import Api, EngineError
from gateway.protocol.request import GenerationRequest
from gateway.protocol.usage import Usage


def capped_body(request: GenerationRequest, output_cap: int | None) -> dict[str, Any]:
    """The client's body, asking for at most ``output_cap`` output tokens when admission
    capped it (``output_past_window: cap``); the request's own body is never changed."""
    body = request.body
    if output_cap is None:
        return body
    if request.api is Api.TGI:
        return {**body, "parameters": {**body["parameters"], "max_new_tokens": output_cap}}
    body = dict(body)  # keys keep their places: the same bytes as the body edited in place
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = output_cap
        body.pop("max_tokens", None)
    else:
        body["max_tokens"] = output_cap
    return body


def upstream_body(request: GenerationRequest, output_cap: int | None = None) -> bytes:
    """The client's body (capped, see ``capped_body``), plus a request for the usage chunk on
    OpenAI streams (token truth).

    Continuous usage stats count only with ``include_usage`` (vLLM, SGLang): a client that
    asked for them alone gets none, so they are not asked for on its behalf either.
    """
    if request.api is Api.OPENAI and request.stream and not request.wants_usage:
        body = capped_body(request, output_cap)
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        options.pop("continuous_usage_stats", None)
        return orjson.dumps({**body, "stream_options": options})
    if output_cap is not None:
        return orjson.dumps(capped_body(request, output_cap))
    return request.raw


def usage_of(payload: Any, api: Api) -> Usage:
    """The token counts in a whole answer (OpenAI ``usage``, TGI ``details``)."""
    if isinstance(payload, list) and payload:  # TGI compat route answers a list
        payload = payload[0]
    if not isinstance(payload, dict):
        return Usage()
    if api is Api.ANTHROPIC:
        return anthropic_usage(payload.get("usage"), _text_or_none(payload.get("stop_reason")))
    if api is Api.OPENAI:
        usage = payload.get("usage")
        choices = payload.get("choices")
        finish = None
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            finish = _text_or_none(choices[0].get("finish_reason"))
        if isinstance(usage, dict):
            return Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), finish)
        return Usage(finish_reason=finish)
    details = payload.get("details")
    if isinstance(details, dict):
        return Usage(details.get("input_length"), details.get("generated_tokens"),
                     _text_or_none(details.get("finish_reason")))
    return Usage()


def anthropic_usage(usage: Any, stop_reason: str | None) -> Usage:
    """Anthropic's usage as token counts: the prompt is its input plus what was read from or
    written to the engine's cache (Anthropic counts those apart)."""
    if not isinstance(usage, dict):
        return Usage(finish_reason=stop_reason)
    parts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                    "cache_creation_input_tokens")]
    prompt = sum(p for p in parts if isinstance(p, int)) if isinstance(parts[0], int) else None
    output = usage.get("output_tokens")
    return Usage(prompt, output if isinstance(output, int) else None, stop_reason)


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class PassThrough:
    """The translation that translates nothing (``gateway.protocol.translate.Translation``)."""

    __slots__ = ("request", "output_cap")

    def __init__(self, request: GenerationRequest, output_cap: int | None = None) -> None:
        self.request = request
        self.output_cap = output_cap  # admission's (``output_past_window: cap``), if any

    @property
    def path(self) -> str:
        return self.request.path

    @property
    def body(self) -> bytes:
        return upstream_body(self.request, self.output_cap)

    def reader(self) -> "EventReader":
        request = self.request
        return EventReader(request.api,
                           strip_usage=request.api is Api.OPENAI and not request.wants_usage)

    def response(self, content: bytes, headers: Mapping[str, str]
                 ) -> tuple[bytes, Usage, list[tuple[bytes, bytes]]]:
        """The engine's body as it is, and its usage (TGI's /generate reports counts in
        headers when details are off)."""
        try:
            usage = usage_of(orjson.loads(content), self.request.api)
        except orjson.JSONDecodeError:
            usage = Usage()
        generated, prompt = headers.get("x-generated-tokens", ""), headers.get("x-prompt-tokens", "")
        if usage.completion_tokens is None and generated.isdigit():
            usage.completion_tokens = int(generated)
        if usage.prompt_tokens is None and prompt.isdigit():
            usage.prompt_tokens = int(prompt)
        return content, usage, []

    def engine_error(self, error: EngineError) -> EngineError:
        return error  # the engine speaks the client's dialect: its error goes as it is


# Events that carry no token: the chat role chunk and empty closing deltas (compact JSON,
# as engines write it). They must not count as tokens when an engine sends no usage.
_TOKENLESS = (b'"content":""', b'"content":null', b'"delta":{}', b'"text":""')


def _tokenless_events(out: bytes) -> int:
    return sum(out.count(marker) for marker in _TOKENLESS)


def _stamped(events: bytes, field: bytes) -> bytes:
    """``field`` added at the end of each terminal chunk (one with a finish reason) that has
    no fingerprint: where vLLM writes it when the client asked for no usage."""
    parts = events.split(b"\n\n")
    for i, event in enumerate(parts):
        if (b'"finish_reason":"' in event and b'"system_fingerprint"' not in event
                and event.endswith(b"}")):
            parts[i] = event[:-1] + field + b"}"
    return b"\n\n".join(parts)


def _named(events: bytes, name: bytes) -> bool:
    """Whether an event named ``name`` is among ``events`` (its line ends with a raw newline,
    which no JSON string holds: a token's text cannot fake one)."""
    return (events.find(b"event: " + name + b"\n") >= 0
            or events.find(b"event:" + name + b"\n") >= 0)


class EventReader:
    """Splits upstream bytes on SSE event boundaries and reads what the gateway needs.

    Only complete events are forwarded (a partial one waits for its end). Events are parsed
    only when they carry usage or TGI's final details, which is once per stream.
    """

    __slots__ = ("api", "strip_usage", "partial", "withheld", "usage", "token_events",
                 "finished")

    def __init__(self, api: Api, strip_usage: bool) -> None:
        self.api = api
        self.strip_usage = strip_usage
        self.partial = b""  # an event not yet complete
        self.withheld = b""  # complete events waiting for the usage chunk (see feed)
        self.usage = Usage()
        self.token_events = 0
        self.finished = False

    @property
    def pending(self) -> bytes:
        """What is left at the end of the stream: events withheld, and an unterminated one."""
        return self.withheld + self.partial

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        """Returns the bytes to forward now and how many token events they hold."""
        if not self.partial and chunk.endswith(b"\n\n"):  # the usual case: whole events
            out = chunk
        else:
            data = self.partial + chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                self.partial = data
                return b"", 0
            cut += 2
            out, self.partial = data[:cut], data[cut:]
        if self.withheld:
            out, self.withheld = self.withheld + out, b""
        if self.api is Api.ANTHROPIC:
            return out, self._anthropic(out)
        # Patterns are looked for with find, not `in`: CPython 3.11's `bytes in bytes` first
        # tries the needle as an int and formats the TypeError it clears (about a thousand
        # instructions a test, on every event).
        find = out.find
        if (self.strip_usage and find(b'"finish_reason":"') >= 0 and find(b'"choices":[]') < 0
                and find(b"data: [DONE]\n") < 0 and find(b"data:[DONE]\n") < 0):
            # vLLM stamps its system_fingerprint on the terminal chunks only when no usage
            # chunk follows. The gateway asked for one on the client's behalf, so a read
            # that ends a choice waits for the next (the usage chunk follows at once) to
            # learn the fingerprint and put it back where the client would have had it.
            self.withheld = out
            return b"", 0
        # Events are the lines that start with `data:` (JSON strings hold no raw newline,
        # so a token's text cannot fake one).
        events = out.count(b"\ndata:") + out.startswith(b"data:")
        if self.api is Api.OPENAI:
            if find(b"data: [DONE]\n") >= 0 or find(b"data:[DONE]\n") >= 0:
                self.finished = True
                events -= 1
            if find(b'"usage"') >= 0 and (find(b'"usage":{') >= 0 or find(b'"usage": {') >= 0):
                out, events = self._read_usage(out, events)
                find = out.find
            at = find(b'"finish_reason":"')
            if at >= 0:  # the terminal chunk: its reason, read off the bytes
                at += 17
                self.usage.finish_reason = out[at:out.find(b'"', at)].decode(errors="replace")
            if find(b'""') >= 0 or find(b'{}') >= 0 or find(b'"content":null') >= 0:
                events -= _tokenless_events(out)
        elif find(b'"generated_text":"') >= 0 or (find(b'"details"') >= 0 and (
                find(b'"details":{') >= 0 or find(b'"details": {') >= 0)):
            self._read_tgi_final(out)
        if find(b'"error"') >= 0:  # the engine's own error event ends the stream; no token
            errors = out.count(b'data: {"error":') + out.count(b'data:{"error":')
            if errors:
                self.finished = True
                events -= errors
        self.token_events += max(events, 0)
        return out, max(events, 0)

    def _read_usage(self, out: bytes, events: int) -> tuple[bytes, int]:
        """Read the last usage in ``out`` (usage is cumulative); drop a usage-only chunk the
        client did not ask for. Only that one event is parsed."""
        at = max(out.rfind(b'"usage":{'), out.rfind(b'"usage": {'))
        start = out.rfind(b"data:", 0, at)
        end = out.find(b"\n\n", at) + 2
        parsed = orjson.loads(out[start + 5:end])
        usage = parsed.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                               self.usage.finish_reason)
        if not parsed.get("choices"):  # the usage-only chunk carries no token
            events -= 1
            if self.strip_usage:
                fingerprint = parsed.get("system_fingerprint")
                head = out[:start]
                if isinstance(fingerprint, str):
                    head = _stamped(head, b',"system_fingerprint":' + orjson.dumps(fingerprint))
                out = head + out[end:]
        return out, events

    def _anthropic(self, out: bytes) -> int:
        """Anthropic's named events: a token per content delta; the prompt's count in
        ``message_start``, the output's and the stop reason in ``message_delta`` (each parsed
        once per stream); ``message_stop`` or ``error`` ends it."""
        if _named(out, b"message_start") or _named(out, b"message_delta"):
            for event in out.split(b"\n\n"):
                kind, _, data = event.partition(b"data:")
                if b"message_start" in kind:
                    message = orjson.loads(data).get("message") or {}
                    self.usage = anthropic_usage(message.get("usage"), None)
                elif b"message_delta" in kind:
                    parsed = orjson.loads(data)
                    later = anthropic_usage(parsed.get("usage"),
                                            (parsed.get("delta") or {}).get("stop_reason"))
                    self.usage = Usage(later.prompt_tokens if later.prompt_tokens is not None
                                       else self.usage.prompt_tokens,
                                       later.completion_tokens, later.finish_reason)
        if _named(out, b"message_stop") or _named(out, b"error"):
            self.finished = True
        tokens = out.count(b"event: content_block_delta\n") + out.count(b"event:content_block_delta\n")
        self.token_events += tokens
        return tokens

    def _read_tgi_final(self, out: bytes) -> None:
        for event in out.split(b"\n\n"):
            payload = event.partition(b"data:")[2].strip()
            if not payload.startswith(b"{"):
                continue
            parsed = orjson.loads(payload)
            if parsed.get("generated_text") is not None:
                self.finished = True
                self.usage = usage_of(parsed, Api.TGI)
