"""How an answer reaches the client: a whole body, or a stream's start, events and end.

Under uvicorn's httptools server (what ``llm-gateway serve`` runs) the status line and
headers go out in the same write as the whole body or a stream's first token, and a stream's
chunks are written straight onto the connection's transport as HTTP/1.1 chunks, from the
relay's upstream read callback: one ``transport.write`` per upstream read, with no ASGI
message, coroutine or task switch per event (``gateway.api.uvicorn_cycle``). The response
ends through ASGI ``send`` as usual, so uvicorn's keep-alive and pipelining stay exact.

Under any other ASGI server the stream goes through ``send``: writes are queued and one task
sends them, coalescing what arrived while the previous send was in progress.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

from gateway.api.uvicorn_cycle import (can_write_head, chunked_transport, httptools_cycle,
                                      transport_of, write_head)
from gateway.dataplane.reply import Sink

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
    if cycle is not None and status not in (204, 304) and can_write_head(cycle, status):
        write_head(cycle, status, headers, None, first)
        return _TransportSink(*transport_of(cycle), send)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    transport = chunked_transport(cycle) if cycle is not None else None
    sink = _TransportSink(*transport, send) if transport is not None else _SendSink(send)
    sink.write(first)
    return sink


async def send_whole(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                     body: bytes) -> None:
    """A whole answer (``content-length``): head and body in one write."""
    cycle = httptools_cycle(send)
    if cycle is not None and can_write_head(cycle, status):
        write_head(cycle, status, headers, len(body), body)
        await send({"type": "http.response.body", "body": b""})  # uvicorn ends the exchange
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


class _TransportSink(ClientSink):
    __slots__ = ("send", "transport", "flow", "_waiter")

    def __init__(self, transport: asyncio.Transport, flow: Any, send: Send) -> None:
        self.send = send
        self.transport, self.flow = transport, flow
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
