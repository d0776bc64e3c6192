"""How a streamed answer reaches the client once its response has started.

Under uvicorn's httptools server (what ``llm-gateway serve`` runs) the stream is written
straight onto the connection's transport as HTTP/1.1 chunks, from the relay's upstream read
callback: one ``transport.write`` per upstream read, with no ASGI message, coroutine or task
switch per event. The response is started and ended through ASGI ``send`` as usual, so
uvicorn's own state (chunked framing, keep-alive, pipelining) stays exact.

Under any other ASGI server the stream goes through ``send``: writes are queued and one task
sends them, coalescing what arrived while the previous send was in progress.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from gateway.api.client_connection import HttptoolsCycle, httptools_cycle
from gateway.relay import Sink

Send = Callable

HIGH_WATER = 64 * 1024  # bytes queued for a slow client before the relay stops reading


class ClientSink(Sink, Protocol):
    """The relay's ``Sink`` on the client's side, plus how the response ends."""

    async def finish(self) -> None:
        """End the response (the last, empty chunk); only after the stream ended."""

    def close(self) -> None:
        """Give up (the client left, or the request failed): stop whatever still runs."""


def client_sink(send: Send) -> ClientSink:
    """The sink for a response already started with ``send``."""
    cycle = httptools_cycle(send)
    if cycle is not None and cycle.chunked_encoding is True:
        return _TransportSink(cycle, send)
    return _SendSink(send)


class _TransportSink(ClientSink):
    __slots__ = ("cycle", "send", "transport", "flow", "_waiter")

    def __init__(self, cycle: "HttptoolsCycle", send: Send) -> None:
        self.cycle, self.send = cycle, send
        self.transport, self.flow = cycle.transport, cycle.flow
        self._waiter: asyncio.Task[None] | None = None

    def write(self, data: bytes) -> None:
        if data and not self.cycle.disconnected:
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def full(self) -> bool:
        return self.flow.write_paused and not self.cycle.disconnected

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

    def write(self, data: bytes) -> None:
        if data:
            self.queue.append(data)
            self.queued += len(data)
            self.wakeup.set()

    def full(self) -> bool:
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
