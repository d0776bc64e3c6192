"""Where the load generator sends and how: a ``Target`` (URL, API, endpoint, streaming) and
one keep-alive HTTP/1.1 connection written on asyncio protocols, which parses responses
(content-length, chunked, until-close) and counts SSE token events with one timestamp per read.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.bench.records import (BAD_RESPONSE, DEFAULT_ENDPOINTS, DISCONNECTED,
                                   INCOMPLETE_STREAM, STREAM_ERROR, TIMEOUT, Api, Record, Request)


class Target:
    """Where to send and how: base URL, API, endpoint path, streaming, model."""

    def __init__(self, url: str, api: Api = "openai", endpoint: str | None = None,
                 stream: bool = False, model: str | None = None,
                 extra_body: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"target URL must be http(s)://host[:port][/path], got {url!r}")
        if api not in ("openai", "tgi"):
            raise ValueError(f"api must be 'openai' or 'tgi', got {api!r}")
        self.url, self.api, self.stream, self.model = url, api, stream, model
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        path = parts.path.rstrip("/")
        if endpoint is None and not path.endswith(("completions", "/generate", "/generate_stream")):
            # a base path ("/v1", "/proxy/llm"): the default endpoint goes under it
            default = DEFAULT_ENDPOINTS[(api, stream)]
            endpoint = path.removesuffix("/v1") + default
        self.endpoint = endpoint or path
        self.chat = self.endpoint.rstrip("/").endswith("chat/completions")
        self.extra_body = extra_body or {}
        netloc = parts.netloc.rpartition("@")[2]
        self._head = (f"POST {self.endpoint} HTTP/1.1\r\nHost: {netloc}\r\n"
                      "Content-Type: application/json\r\nAccept: */*\r\n"
                      + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()))

    def body(self, request: Request) -> dict[str, Any]:
        if self.api == "tgi":
            body: dict[str, Any] = {"inputs": request.text(), "parameters": {
                "max_new_tokens": request.max_tokens, "details": True}}
        else:
            body = {"model": self.model} if self.model else {}
            if self.chat:
                body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
            else:
                body["prompt"] = request.text()
            body["max_tokens"] = request.max_tokens
            body["stream"] = self.stream
            if self.stream:
                body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return body

    def encode(self, request: Request) -> bytes:
        """The whole HTTP request, ready to write."""
        payload = orjson.dumps(self.body(request))
        return (self._head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload

    async def connect(self) -> "_Conn":
        loop = asyncio.get_running_loop()
        tls = ssl.create_default_context() if self.tls else None
        _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port,
                                               ssl=tls)
        return conn


# ---------------------------------------------------------------------------------------------
# One keep-alive connection: HTTP/1.1 response parsing (content-length, chunked, until-close)
# and SSE token accounting.

_HEAD, _BODY, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER, _UNTIL_CLOSE = range(6)
# Events that need parsing (usage, TGI details, errors), compact or with a space (json.dumps).
_SPECIAL = (b'"usage":{', b'"usage": {', b'"error":', b'"details":{', b'"details": {')
_now = time.perf_counter


def _last_events(events: bytes, n: int = 3) -> int:
    """Offset of the last ``n`` events of whole SSE events (searching backwards: cheap)."""
    end = len(events) - 2
    for _ in range(n):
        end = events.rfind(b"\n\n", 0, end)
        if end < 0:
            return 0
    return end + 2


def _special(events: bytes, start: int) -> bool:
    """Any of ``_SPECIAL`` from ``start`` on (unrolled: this runs once per read)."""
    return (events.find(b'"usage":{', start) >= 0 or events.find(b'"error":', start) >= 0
            or events.find(b'"details":{', start) >= 0 or events.find(b'"usage": {', start) >= 0
            or events.find(b'"details": {', start) >= 0)


def _data_lines(events: bytes) -> int:
    """``data:`` lines in whole SSE events, but ``[DONE]``: one token event each."""
    n = events.startswith(b"data:") + events.count(b"\ndata:")
    return n - (b"data: [DONE]" in events or b"data:[DONE]" in events)


class _Conn(asyncio.Protocol):
    def __init__(self, target: Target) -> None:
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.state = _HEAD
        self.remaining = 0
        self.closed = False
        self.keep_alive = True
        self.record: Record | None = None
        self.waiter: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.events_body = False    # this response is an SSE stream
        self.partial = b""          # an SSE event cut by a read boundary
        self.body: list[bytes] = []
        self.usage_output: int | None = None
        self.stream_ended = False   # the stream's last event (see INCOMPLETE_STREAM) arrived

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.record is not None:
            if self.state == _UNTIL_CLOSE:
                self._finish()
            else:
                self._fail(DISCONNECTED, str(exc or "connection closed by the server"))

    def data_received(self, data: bytes) -> None:
        if self.record is None:
            return
        buf = self.buf
        buf += data
        try:
            self._parse(buf)
        except (ValueError, IndexError) as exc:
            self._fail(BAD_RESPONSE, f"unparseable HTTP response: {exc}")
            self.close()

    def _parse(self, buf: bytearray) -> None:
        while self.record is not None:
            state = self.state
            if state == _HEAD:
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    return
                self._head(bytes(buf[:i]))
                del buf[:i + 4]
            elif state == _BODY:
                if not buf:
                    return
                piece = bytes(buf[:self.remaining])
                del buf[:len(piece)]
                self.remaining -= len(piece)
                self._piece(piece)
                if self.remaining == 0:
                    self._finish()
            elif state == _CHUNK_SIZE:
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                size = int(bytes(buf[:i]).split(b";")[0], 16)
                del buf[:i + 2]
                if size == 0:
                    self.state = _TRAILER
                else:
                    self.remaining, self.state = size, _CHUNK_DATA
            elif state == _CHUNK_DATA:
                if len(buf) < self.remaining + 2:
                    return
                piece = bytes(buf[:self.remaining])
                del buf[:self.remaining + 2]
                self.state = _CHUNK_SIZE
                self._piece(piece)
            elif state == _TRAILER:
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                del buf[:i + 2]
                if i == 0:
                    self._finish()
            else:  # _UNTIL_CLOSE
                if buf:
                    self._piece(bytes(buf))
                    buf.clear()
                return

    def _head(self, raw: bytes) -> None:
        record = self.record
        assert record is not None
        head = raw.lower()
        record.status = status = int(head[9:12])
        self.keep_alive = b"\r\nconnection: close" not in head
        for name, attr in ((b"\r\nx-gateway-replica:", "replica"), (b"\r\nx-gateway-pool:", "pool")):
            i = head.find(name)
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                # values keep their case: read them from the raw head
                setattr(record, attr, raw[i + len(name):j if j >= 0 else None].strip().decode())
        i = head.find(b"\r\nx-prompt-tokens:")
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            value = head[i + 18:j if j >= 0 else None].strip()
            if value.isdigit():
                record.prompt_tokens = int(value)
        self.events_body = self.target.stream and status == 200 and b"text/event-stream" in head
        if b"\r\ntransfer-encoding: chunked" in head:
            self.state = _CHUNK_SIZE
            return
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            self.remaining = int(head[i + 17:j if j >= 0 else None].strip())
            if self.remaining == 0:
                self._finish()
            else:
                self.state = _BODY
        elif status in (204, 304) or 100 <= status < 200:
            self._finish()
        else:
            self.state, self.keep_alive = _UNTIL_CLOSE, False

    def _piece(self, data: bytes) -> None:
        if not self.events_body:
            self.body.append(data)
            return
        if self.partial:
            data = self.partial + data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.partial = data
            return
        if cut + 2 < len(data):
            self.partial, data = data[cut + 2:], data[:cut + 2]
        else:
            self.partial = b""
        record = self.record
        assert record is not None
        # Usage, TGI details and errors come in a stream's last events, the chat role in its
        # first: look only there, so a read of many events costs one count.
        tail = _last_events(data)
        if data.find(b'"generated_text":"' if self.target.api == "tgi" else b"[DONE]", tail) >= 0:
            self.stream_ended = True
        chat_start = (self.target.chat and record.first_token is None
                      and data.find(b'"role":', 0, data.find(b"\n\n")) >= 0)
        if chat_start or _special(data, tail):
            tokens = self._events_slow(data, tail, chat_start)
        else:  # every `data:` line but [DONE] is one token event
            tokens = _data_lines(data)
        if tokens > 0:
            now = _now()
            if record.first_token is None:
                record.first_token = now
            record.events += tokens
            record.chunks.append((now, tokens))

    def _events_slow(self, data: bytes, tail: int, chat_start: bool) -> int:
        """Count as the fast path does, then parse the events that carry usage, TGI details,
        an error (from ``tail`` on) or the chat role (first event), and take back those that
        carry no token."""
        tokens = _data_lines(data)
        starts = {0} if chat_start else set()
        for marker in _SPECIAL:
            i = data.find(marker, tail)
            while i >= 0:
                boundary = data.rfind(b"\n\n", 0, i)   # JSON holds no raw newline
                starts.add(boundary + 2 if boundary >= 0 else 0)
                i = data.find(marker, i + 1)
        for start in starts:
            end = data.find(b"\n\n", start)
            event = data[start:end if end >= 0 else None].strip()
            if not event.startswith(b"data:"):
                continue
            try:
                obj = orjson.loads(event[5:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and not self._special_event(obj):
                tokens -= 1
        return tokens

    def _special_event(self, obj: dict[str, Any]) -> bool:
        """Take what an event says about usage or errors; True if it also carries a token."""
        record = self.record
        assert record is not None
        if obj.get("error"):
            error = obj["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            record.error, record.detail = STREAM_ERROR, str(message)[:300]
            return False
        if self.target.api == "tgi" or "token" in obj:
            details = obj.get("details")
            if isinstance(details, dict):
                self._usage(details.get("input_length"), details.get("generated_tokens"))
            return "token" in obj
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content") or delta.get("tool_calls") \
                    or delta.get("reasoning_content"):
                return True
        return False

    def _usage(self, prompt: Any, output: Any) -> None:
        if isinstance(prompt, int):
            self.record.prompt_tokens = prompt  # type: ignore[union-attr]
        if isinstance(output, int):
            self.usage_output = output

    def _finish(self) -> None:
        record = self.record
        assert record is not None
        record.end = _now()
        self.state = _HEAD
        if self.events_body:
            if self.partial.strip():
                self._piece(b"\n\n")           # a last event without its blank line
        elif self.body:
            self._json_body(b"".join(self.body))
        if record.error is None and record.status != 200:
            record.error = f"http_{record.status}"
        if record.error is None and self.events_body and not self.stream_ended:
            record.error, record.detail = INCOMPLETE_STREAM, "the stream ended without its last event"
        record.output_tokens = self.usage_output if self.usage_output is not None else record.events
        if not self.keep_alive:
            self.close()
        self._settle()

    def _json_body(self, body: bytes) -> None:
        record = self.record
        assert record is not None
        if record.status != 200:
            record.detail = body[:300].decode(errors="replace")
            return
        if record.first_token is None:
            record.first_token = record.end
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            record.error, record.detail = BAD_RESPONSE, body[:300].decode(errors="replace")
            return
        if isinstance(obj, list) and obj:      # TGI `POST /` answers a list
            obj = obj[0]
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        details = obj.get("details")
        if isinstance(usage, dict):
            self._usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
        elif isinstance(details, dict):
            self._usage(None, details.get("generated_tokens"))

    def _fail(self, kind: str, detail: str) -> None:
        record = self.record
        if record is None:
            return
        record.end = _now()
        if record.error is None:
            record.error, record.detail = kind, detail[:300]
        record.output_tokens = self.usage_output if self.usage_output is not None else record.events
        self._settle()

    def _settle(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.record = None
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _timed_out(self) -> None:
        self.timer = None
        self._fail(TIMEOUT, "no complete response within the timeout")
        self.close()

    # API
    def request(self, raw: bytes, record: Record, timeout: float) -> asyncio.Future:
        """Write ``raw``; the future resolves when ``record`` is complete (success or not)."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.record = record
        self.state, self.partial, self.body, self.usage_output = _HEAD, b"", [], None
        self.stream_ended = False
        self.buf.clear()
        self.timer = loop.call_later(timeout, self._timed_out)
        record.sent = _now()
        self.transport.write(raw)  # type: ignore[union-attr]
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
