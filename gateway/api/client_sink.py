"""How an answer reaches the client: a whole body, or a stream's start, events and end.

Under uvicorn's httptools server (what ``llm-gateway serve`` runs) the stream is written
straight onto the connection's transport as HTTP/1.1 chunks, from the relay's upstream read
callback: one ``transport.write`` per upstream read, with no ASGI message, coroutine or task
switch per event. The status line and headers go out in the same write as the first token,
or as the whole body (one write and one client wake-up instead of two), with the cycle's
state set as uvicorn's own start would set it; the response ends through ASGI ``send`` as
usual, so uvicorn's keep-alive and pipelining stay exact.

Under any other ASGI server the stream goes through ``send``: writes are queued and one task
sends them, coalescing what arrived while the previous send was in progress.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from gateway.api.client_connection import HttptoolsCycle, httptools_cycle
from gateway.dataplane.reply import Sink

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE
except ImportError:  # pragma: no cover - uvicorn without httptools
    STATUS_LINE = {}

Send = Callable

HIGH_WATER = 64 * 1024  # bytes queued for a slow client before the relay stops reading


class ClientSink(Sink, Protocol):
    """The relay's ``Sink`` on the client's side, plus how the response ends."""

    async def finish(self) -> None:
        """End the response (the last, empty chunk); only after the stream ended."""

    def close(self) -> None:
        """Give up (the client left, or the request failed): stop whatever still runs."""


async def open_stream(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                      first: bytes) -> ClientSink:
    """Start a streamed (chunked) response with ``first`` as its first chunk; the sink takes
    the rest."""
    cycle = httptools_cycle(send)
    if cycle is not None and _can_start(cycle, status) and status not in (204, 304):
        _write_head(cycle, status, headers, None, first)
        return _TransportSink(cycle, send)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    sink = (_TransportSink(cycle, send) if cycle is not None and cycle.chunked_encoding is True
            else _SendSink(send))
    sink.write(first)
    return sink


async def send_whole(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                     body: bytes) -> None:
    """A whole answer (``content-length``): head and body in one write."""
    cycle = httptools_cycle(send)
    if cycle is not None and _can_start(cycle, status):
        _write_head(cycle, status, headers, len(body), body)
        await send({"type": "http.response.body", "body": b""})  # uvicorn ends the exchange
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


# ``_write_head`` reads and sets uvicorn's private request-cycle state, as its own start
# does. It was checked against these uvicorn releases (from, up to but not including), and
# pyproject.toml pins uvicorn to them; any other uvicorn keeps its own start (and a test
# fails, so the next release is checked before the pin moves).
CHECKED_UVICORN = ((0, 29), (0, 55))
_CYCLE_STATE = ("response_started", "disconnected", "access_log", "flow", "scope",
                "default_headers", "keep_alive", "transport", "waiting_for_100_continue",
                "chunked_encoding", "expected_content_length")
_cycle_known: bool | None = None  # whether this uvicorn's cycle has it all (checked once)


def uvicorn_checked() -> bool:
    """The running uvicorn is one ``_write_head`` was checked against."""
    from uvicorn import __version__
    release = tuple(int(part) for part in __version__.split(".")[:2])
    return CHECKED_UVICORN[0] <= release < CHECKED_UVICORN[1]


def _can_start(cycle: "HttptoolsCycle", status: int) -> bool:
    """The cases uvicorn's start handles the plain way (a HEAD, an access log to write, a
    client not keeping up, one gone, a status it has no line for) are left to it, and so
    is every answer under a uvicorn whose cycle is not the one ``_write_head`` knows."""
    global _cycle_known
    if _cycle_known is None:
        _cycle_known = uvicorn_checked() and all(hasattr(cycle, name) for name in _CYCLE_STATE)
    return (_cycle_known and status in STATUS_LINE and not cycle.response_started
            and not cycle.disconnected and not cycle.access_log
            and not cycle.flow.write_paused and cycle.scope["method"] != "HEAD")


def _write_head(cycle: "HttptoolsCycle", status: int, headers: list[tuple[bytes, bytes]],
                length: int | None, payload: bytes) -> None:
    """What uvicorn's ``http.response.start`` writes and sets, and the payload in the same
    write: the whole body (``length``) or, chunked (``None``), the first chunk. The cycle
    is left as after uvicorn's own start and that payload, so its ``send`` ends the exchange
    (keep-alive, pipelining) as usual.

    ``headers`` carry no length, framing or connection header (the relay drops the
    replica's). They are not checked as uvicorn checks them: the replica's were parsed by
    llhttp, which refuses control characters in names and values, and the gateway's own are
    names it chose and values it made (ids checked printable, numbers)."""
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = length is None
    cycle.expected_content_length = 0  # nothing more is due
    content = [STATUS_LINE[status]]
    for name, value in cycle.default_headers:
        content += [name, b": ", value, b"\r\n"]
    for name, value in headers:
        content += [name.lower(), b": ", value, b"\r\n"]
    if length is not None:  # in uvicorn's order: the app's headers, then its own
        content.append(b"content-length: %d\r\n" % length)
    if not cycle.keep_alive:
        content.append(b"connection: close\r\n")
    if length is None:
        content.append(b"transfer-encoding: chunked\r\n\r\n")
        if payload:
            content += [b"%x\r\n" % len(payload), payload, b"\r\n"]
    else:
        content += [b"\r\n", payload]
    cycle.transport.write(b"".join(content))


class _TransportSink(ClientSink):
    __slots__ = ("send", "transport", "flow", "_waiter")

    def __init__(self, cycle: "HttptoolsCycle", send: Send) -> None:
        self.send = send
        self.transport, self.flow = cycle.transport, cycle.flow
        self._waiter: asyncio.Task[None] | None = None

    def write(self, data: bytes) -> bool:
        # Called per upstream read of hundreds of streams: the transport is asked, not
        # uvicorn's request state (a closing transport is a client gone).
        transport = self.transport
        if transport.is_closing():
            return False
        if data:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return self.flow.write_paused

    def when_drained(self, callback: Callable[[], None]) -> None:
        async def drained() -> None:
            await self.flow.drain()
            callback()

        self._waiter = asyncio.ensure_future(drained())

    async def finish(self) -> None:
        await self.send({"type": "http.response.body", "body": b""})

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.cancel()


class _SendSink(ClientSink):
    __slots__ = ("send", "queue", "queued", "drained", "wakeup", "pump", "ending")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.queue: list[bytes] = []
        self.queued = 0
        self.drained: list[Callable[[], None]] = []
        self.wakeup = asyncio.Event()
        self.ending = False
        self.pump = asyncio.ensure_future(self._pump())

    def write(self, data: bytes) -> bool:
        if data:
            self.queue.append(data)
            self.queued += len(data)
            self.wakeup.set()
        return self.queued > HIGH_WATER

    def when_drained(self, callback: Callable[[], None]) -> None:
        self.drained.append(callback)

    async def _pump(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            if self.queue:
                chunk, self.queue, self.queued = b"".join(self.queue), [], 0
                callbacks, self.drained = self.drained, []
                await self.send({"type": "http.response.body", "body": chunk,
                                 "more_body": True})
                for callback in callbacks:
                    callback()
            if self.ending and not self.queue:
                return

    async def finish(self) -> None:
        self.ending = True
        self.wakeup.set()
        await self.pump
        await self.send({"type": "http.response.body", "body": b""})

    def close(self) -> None:
        self.pump.cancel()
