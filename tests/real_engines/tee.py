"""A recording TCP proxy on loopback: what the engine sent for each request, byte for byte.

Two requests to a real engine need not stream alike: vLLM puts the tokens of several steps
into one chunk when its API server falls behind (a busy CPU), so "the same request sent
straight to the engine" is not a fixed reference. The reference is what the engine sent
the gateway for *this* request: the gateway's replica URL is this proxy, which passes both
directions through untouched and keeps a copy, parsed back into HTTP exchanges with h11.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

import h11

from support import free_port


@dataclass
class Exchange:
    method: str
    target: str
    request_body: bytes
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass
class _Connection:
    sent: bytearray = field(default_factory=bytearray)      # to the engine
    received: bytearray = field(default_factory=bytearray)  # from the engine


class Tee:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.connections: list[_Connection] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    copy: bytearray) -> None:
        try:
            while data := await reader.read(65536):
                with self._lock:
                    copy += data
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        engine_reader, engine_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        connection = _Connection()
        with self._lock:
            self.connections.append(connection)
        await asyncio.gather(self._pipe(client_reader, engine_writer, connection.sent),
                             self._answer(engine_reader, client_writer, engine_writer,
                                          connection))

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      engine: asyncio.StreamWriter, connection: _Connection) -> None:
        """The engine's side, to the client (kept)."""
        await self._pipe(reader, writer, connection.received)

    def exchanges(self) -> list[Exchange]:
        """Every complete request/response pair seen so far, per connection in order."""
        with self._lock:
            copies = [(bytes(c.sent), bytes(c.received)) for c in self.connections]
        out = []
        for sent, received in copies:
            server, client = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
            server.receive_data(sent)
            client.receive_data(received)
            with contextlib.suppress(h11.ProtocolError):  # a connection cut mid-exchange
                while (exchange := _next_request(server, client)) is not None:
                    if not _read_response(client, exchange):
                        break
                    out.append(exchange)
                    if server.our_state is h11.SEND_RESPONSE:  # the server side's turn, done
                        server.send(h11.Response(status_code=200,
                                                 headers=[("content-length", "0")]))
                        server.send(h11.EndOfMessage())
                    server.start_next_cycle()
                    client.start_next_cycle()
        return out

    def last(self, method: str, target: str) -> Exchange:
        found = [e for e in self.exchanges() if e.method == method and e.target == target]
        assert found, f"no {method} {target} went through the tee"
        return found[-1]


class Cutter(Tee):
    """A tee that breaks the next answer after its ``cut_after``-th token chunk (one with
    ``"token_ids":[``, which the gateway asks a stream it may continue for): it passes the
    engine's bytes up to that event's end, then drops both connections, as an engine that
    dies there would. One cut per ``cut_after`` set; None: pass everything. ``ended``: the
    cuts that fell after the chunk with the finish reason (only the stream's end was lost)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._cut_after: int | None = None
        self.armed = 0  # how many times a cut was set: a connection counts anew from each
        self.cuts = 0
        self.ended = 0
        self.marker = b'"token_ids":['  # what makes an event count (an engine without ids:
        # ``b"data: {"``, every event)

    @property
    def cut_after(self) -> int | None:
        return self._cut_after

    @cut_after.setter
    def cut_after(self, tokens: int | None) -> None:
        self._cut_after = tokens
        self.armed += tokens is not None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      engine: asyncio.StreamWriter, connection: _Connection) -> None:
        """Bytes pass at once (a health check's answer too); events are only counted, and
        the answer is cut at the end of the ``cut_after``-th one with ids. The count starts
        anew with each cut set: a keep-alive connection may have carried a whole answer
        while the last one was set (vLLM merged its tokens into fewer chunks), and what it
        counted then is not this answer's."""
        tokens, tail, finished = 0, b"", False  # tail: what came since the last event's end
        counting = self.armed
        try:
            while data := await reader.read(65536):
                limit = self.cut_after
                if limit is None:
                    writer.write(data)
                    await writer.drain()
                    continue
                if counting != self.armed:
                    tokens, tail, finished, counting = 0, b"", False, self.armed
                seen, start = tail + data, 0
                while (end := seen.find(b"\n\n", start)) >= 0:
                    tokens += self.marker in seen[start:end]
                    finished = finished or b'"finish_reason":"' in seen[start:end]
                    start = end + 2
                    if tokens >= limit:
                        writer.write(data[:start - len(tail)])
                        await writer.drain()
                        self.cut_after, self.cuts = None, self.cuts + 1
                        self.ended += finished
                        writer.transport.abort()
                        engine.transport.abort()
                        return
                tail = seen[start:]
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()


def _next_request(server: h11.Connection, client: h11.Connection) -> Exchange | None:
    exchange = None
    while True:
        event = server.next_event()
        if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            return None
        if isinstance(event, h11.Request):
            exchange = Exchange(event.method.decode(), event.target.decode(), b"")
            client.send(h11.Request(method=event.method, target=event.target,
                                    headers=event.headers))
        elif isinstance(event, h11.Data) and exchange is not None:
            exchange.request_body += event.data
            client.send(h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            client.send(h11.EndOfMessage())
            return exchange


def _read_response(client: h11.Connection, exchange: Exchange) -> bool:
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            return False
        if isinstance(event, h11.Response):
            exchange.status = event.status_code
            exchange.headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            exchange.body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return True


@contextlib.contextmanager
def tee(target_url: str, kind: type[Tee] = Tee) -> Iterator[Tee]:
    """A ``Tee`` (or a ``Cutter``) in front of ``target_url`` (loopback) until the block
    ends."""
    proxy = kind(int(target_url.rsplit(":", 1)[1]))
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def main() -> None:
        server = await asyncio.start_server(proxy._serve, "127.0.0.1", proxy.port)
        started.set()
        async with server:
            await server.serve_forever()

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10), "the tee did not start"
    try:
        yield proxy
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
