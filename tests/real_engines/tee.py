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
                             self._pipe(engine_reader, client_writer, connection.received))

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
def tee(target_url: str) -> Iterator[Tee]:
    """A ``Tee`` in front of ``target_url`` (loopback) until the block ends."""
    proxy = Tee(int(target_url.rsplit(":", 1)[1]))
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
