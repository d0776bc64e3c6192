"""The data path's HTTP/1.1 client (``gateway.upstream``) against real loopback servers, and
the two ways a stream reaches the client (``gateway.api.client_sink``) under real uvicorn
servers.

The servers here are raw asyncio servers writing exact bytes, so each framing (chunked,
content-length, until-close), a connection the server closes while idle, and a body cut in
the middle are produced on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from gateway.api.client_sink import open_stream, send_whole
from gateway.upstream import (UpstreamConnectError, UpstreamError, UpstreamPool,
                              UpstreamTransportError)
from support import free_port, uvicorn_in_thread, wait_until, wait_until_async

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


class Server:
    """A loopback HTTP server that answers each request with ``handler`` (which returns
    whether to keep the connection open); counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = 0  # connections ended (by either side)
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.handler(reader, writer, len(self.requests)):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()
            self.closed += 1


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, Server]]:
    server = Server(handler)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        listener.close()


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


class Collect:
    """A body handler that keeps what it gets."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.ended = asyncio.get_running_loop().create_future()

    def on_body(self, data: bytes) -> None:
        self.chunks.append(data)

    def on_end(self, error: UpstreamError | None) -> None:
        self.ended.set_result(error)


async def test_a_connection_is_kept_alive_and_reused() -> None:
    async def handler(reader, writer, n) -> bool:
        writer.write(answer(b'{"n": %d}' % n, b"x-engine: sim\r\n"))
        return True

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, server):
        for n in (1, 2, 3):
            response = await pool.request(url, "/v1/completions", b'{"a": 1}',
                                          [(b"content-type", b"application/json")], 1.0)
            assert response.status == 200 and await response.read() == b'{"n": %d}' % n
            assert response.headers["x-engine"] == "sim"
            assert (b"x-engine", b"sim") in response.raw_headers
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\ncontent-length: 8\r\n" in first and first.endswith(b'\r\n\r\n{"a": 1}')
        assert b"\r\ncontent-type: application/json\r\n" in first
    await pool.close()


async def test_a_connection_the_replica_closed_while_idle_is_replaced_once() -> None:
    async def handler(reader, writer, n) -> bool:
        if n == 2:  # closes the kept-alive connection as the request arrives: no answer
            return False
        writer.write(answer(b"ok %d" % n))
        return True

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, server):
        assert await (await pool.request(url, "/", b"", [], 1.0)).read() == b"ok 1"
        response = await pool.request(url, "/", b"", [], 1.0)
        assert await response.read() == b"ok 3"  # sent again on a fresh connection
        assert server.connections == 2 and len(server.requests) == 3
    await pool.close()


async def test_a_fresh_connection_closed_without_an_answer_is_an_error() -> None:
    async def handler(reader, writer, n) -> bool:
        return False

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, server):
        with pytest.raises(UpstreamTransportError):
            await pool.request(url, "/", b"", [], 1.0)
        assert len(server.requests) == 1  # not sent twice
    await pool.close()


async def test_idle_connections_older_than_keepalive_are_not_reused() -> None:
    async def handler(reader, writer, n) -> bool:
        writer.write(answer(b"ok"))
        return True

    pool = UpstreamPool(keepalive=0.05)
    async with serving(handler) as (url, server):
        await (await pool.request(url, "/", b"", [], 1.0)).read()
        await asyncio.sleep(0.1)  # the thing tested: the keep-alive time passes
        await (await pool.request(url, "/", b"", [], 1.0)).read()
        assert server.connections == 2
    await pool.close()


@pytest.mark.parametrize("framing", ["chunked", "until-close"])
async def test_a_streamed_body_is_delivered_read_by_read_and_decoded(framing: str) -> None:
    events = [b"data: {\"t\": %d}\n\n" % i for i in range(3)]

    async def handler(reader, writer, n) -> bool:
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n")
        for event in events:
            await asyncio.sleep(0.01)  # pacing: one event per read
            writer.write(b"%x\r\n%b\r\n" % (len(event), event) if framing == "chunked"
                         else event)
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        return framing == "chunked"

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, server):
        response = await pool.request(url, "/v1/completions", b"{}", [], 1.0)
        body = Collect()
        response.stream(body)
        assert await asyncio.wait_for(body.ended, 5) is None
        assert body.chunks == events  # one call per read, de-chunked
        assert response.ended
    await pool.close()


async def test_a_body_cut_in_the_middle_ends_with_an_error() -> None:
    async def handler(reader, writer, n) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        return False  # closes without the last chunk

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, _):
        response = await pool.request(url, "/", b"", [], 1.0)
        body = Collect()
        response.stream(body)
        error = await asyncio.wait_for(body.ended, 5)
        assert isinstance(error, UpstreamTransportError) and body.chunks == [b"hello"]
    await pool.close()


async def test_nothing_listening_is_a_connect_error() -> None:
    pool = UpstreamPool(keepalive=5)
    with pytest.raises(UpstreamConnectError):
        await pool.request(f"http://127.0.0.1:{free_port()}", "/", b"", [], 1.0)
    await pool.close()


async def test_closing_an_unfinished_response_drops_the_connection() -> None:
    gone = asyncio.Event()

    async def handler(reader, writer, n) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            if await reader.read(1) == b"":  # the gateway closed its end
                gone.set()
        return False

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, server):
        response = await pool.request(url, "/", b"", [], 1.0)
        response.close()
        await asyncio.wait_for(gone.wait(), 5)
        assert response.ended
    await pool.close()


async def test_the_per_replica_limit_holds_an_exchange_until_one_ends() -> None:
    release = asyncio.Event()

    async def handler(reader, writer, n) -> bool:
        if n == 1:
            await release.wait()
        writer.write(answer(b"%d" % n))
        return True

    pool = UpstreamPool(keepalive=5, max_per_origin=1)
    async with serving(handler) as (url, server):
        first = asyncio.ensure_future(pool.request(url, "/", b"", [], 1.0))
        await wait_until_async(lambda: len(server.requests) == 1, 5, "the first request sent")
        second = asyncio.ensure_future(pool.request(url, "/", b"", [], 1.0))
        await asyncio.sleep(0.1)  # a window in which the second must not go out
        assert not second.done() and len(server.requests) == 1  # waiting for the slot
        release.set()
        assert await (await first).read() == b"1"
        assert await (await asyncio.wait_for(second, 5)).read() == b"2"
        assert server.connections == 1
    await pool.close()


# The client side: which sink a stream takes under each uvicorn protocol, and that both
# produce the same chunked body.

EVENTS = (b"data: 1\n\n", b"", b"data: 2\n\n")
HEADERS = [(b"Content-Type", b"text/event-stream"), (b"x-gateway-replica", b"r0")]


async def _sink_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    sink = await open_stream(send, 200, HEADERS, b"first ")
    for event in (type(sink).__name__.encode(), *EVENTS):
        sink.write(event)
        await asyncio.sleep(0.005)  # pacing: one write per event
    await sink.finish()
    sink.close()


@pytest.mark.parametrize("http, sink", [("httptools", b"_TransportSink"), ("h11", b"_SendSink")])
@pytest.mark.parametrize("access_log", [False, True])
def test_a_stream_is_written_straight_to_uvicorns_transport_or_through_send(
        http: str, sink: bytes, access_log: bool) -> None:
    with uvicorn_in_thread(_sink_app, http=http, lifespan="off", access_log=access_log) as port, \
            httpx.Client() as client:
        for _ in range(2):  # the connection stays usable after the stream
            response = client.get(f"http://127.0.0.1:{port}/")
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.headers["content-type"] == "text/event-stream"
            assert response.content == b"first " + sink + b"data: 1\n\ndata: 2\n\n"


WHOLE = b'{"error": {"message": "too long"}}'


CHUNKS, CHUNK = 128, 64 * 1024  # 8 MiB: more than a loopback connection buffers


FLOOD_PAUSED = threading.Event()  # _flood_app has found its sink full


async def _flood_app(scope, receive, send) -> None:
    """Writes numbered 64 KiB chunks; whenever the sink says the client is not keeping up,
    waits until it has drained (as the relay does, by not reading upstream)."""
    if scope["type"] != "http":
        return
    sink = await open_stream(send, 200, HEADERS, b"")
    pauses = 0
    for i in range(CHUNKS):
        if sink.write(b"%06d" % i + b"x" * (CHUNK - 6)):
            pauses += 1
            FLOOD_PAUSED.set()
            drained = asyncio.Event()
            sink.when_drained(drained.set)
            await asyncio.wait_for(drained.wait(), 20)
    sink.write(b"pauses=%d" % pauses)
    await sink.finish()
    sink.close()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_does_not_read_makes_the_sink_full_until_it_has_drained(
        http: str) -> None:
    import socket

    FLOOD_PAUSED.clear()
    with uvicorn_in_thread(_flood_app, http=http, lifespan="off", access_log=False) as port, \
            socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        s.settimeout(20)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        # reads nothing until the server's buffers are full
        wait_until(FLOOD_PAUSED.is_set, 20, "the sink full (the app paused)")
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):
            more = s.recv(1 << 20)
            assert more, "the server closed the connection"
            data += more
    at = data.index(b"\r\n\r\n") + 4
    pieces = []
    while True:  # undo the chunked framing
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        if size == 0:
            break
        pieces.append(data[end + 2:end + 2 + size])
        at = end + 2 + size + 2
    payload = b"".join(pieces)
    numbers = [int(payload[i:i + 6]) for i in range(0, CHUNKS * CHUNK, CHUNK)]
    assert numbers == list(range(CHUNKS))  # everything, in order
    pauses = int(payload[CHUNKS * CHUNK:].removeprefix(b"pauses="))
    assert 1 <= pauses < CHUNKS, pauses


async def _two_ways_app(scope, receive, send) -> None:
    """``/own``: the stream started by ``open_stream``; ``/uvicorn``: by uvicorn's own
    ``http.response.start``, the same status, headers and chunks. ``/own-whole`` and
    ``/uvicorn-whole``: a whole 400 answer by ``send_whole`` and by uvicorn."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/own-whole":
        await send_whole(send, 400, HEADERS, WHOLE)
        return
    if scope["path"] == "/uvicorn-whole":
        await send({"type": "http.response.start", "status": 400,
                    "headers": [*HEADERS, (b"content-length", b"%d" % len(WHOLE))]})
        await send({"type": "http.response.body", "body": WHOLE})
        return
    if scope["path"] == "/own":
        sink = await open_stream(send, 200, HEADERS, b"first ")
        for event in EVENTS:
            sink.write(event)
        await sink.finish()
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    for event in (b"first ", *EVENTS):
        if event:
            await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _raw_exchange(port: int, path: str, close: bool) -> bytes:
    """The response's bytes as sent, read until the body's end (or the close)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n"
                  % (path.encode(), b"connection: close\r\n" if close else b""))
        data = b""
        while not data.endswith((b"0\r\n\r\n", WHOLE)):
            more = s.recv(65536)
            if not more:
                break
            data += more
        return data


def _masked(raw: bytes) -> bytes:
    """Without the date header (it may change between two answers)."""
    return b"\r\n".join(line for line in raw.split(b"\r\n") if not line.startswith(b"date: "))


@pytest.mark.parametrize("close", [False, True])
def test_a_stream_started_in_one_write_has_uvicorns_own_bytes(close: bool) -> None:
    """The status line, headers (uvicorn's date and server first, names lowercased, the
    connection's own close) and chunks are byte for byte what uvicorn writes itself."""
    with uvicorn_in_thread(_two_ways_app, http="httptools", lifespan="off",
                           access_log=False) as port:
        own, plain = (_raw_exchange(port, path, close) for path in ("/own", "/uvicorn"))
    assert _masked(own) == _masked(plain)
    assert own.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-gateway-replica: r0\r\n" in own
    assert (b"connection: close\r\n" in own) is close
    assert own.endswith(b"6\r\nfirst \r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("close", [False, True])
def test_a_whole_answer_in_one_write_has_uvicorns_own_bytes(close: bool) -> None:
    with uvicorn_in_thread(_two_ways_app, http="httptools", lifespan="off",
                           access_log=False) as port:
        own, plain = (_raw_exchange(port, path, close)
                      for path in ("/own-whole", "/uvicorn-whole"))
    assert _masked(own) == _masked(plain)
    assert own.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert own.endswith(b"content-length: %d\r\n%s\r\n%s"
                        % (len(WHOLE), b"connection: close\r\n" if close else b"", WHOLE))


def test_a_connection_stays_usable_after_an_answer_in_one_write() -> None:
    import socket

    request = b"GET /own-whole HTTP/1.1\r\nhost: x\r\n\r\n"
    with uvicorn_in_thread(_two_ways_app, http="httptools", lifespan="off",
                           access_log=False) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for _ in range(3):  # one after the other on the same connection
            s.sendall(request)
            data = b""
            while not data.endswith(WHOLE):
                more = s.recv(65536)
                assert more, "the server closed the connection"
                data += more
            assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1") == 1


async def test_an_answer_nobody_asked_for_closes_the_idle_connection() -> None:
    """A server that answers on an idle kept-alive connection (a 408 before closing, say):
    the connection is dropped, and the next request goes out on a fresh one."""
    async def handler(reader, writer, n) -> bool:
        writer.write(answer(b"ok %d" % n))
        if n == 1:
            await asyncio.sleep(0.02)  # the scenario: the connection idle, then an answer
            writer.write(answer(b"unasked"))  # keeps the connection open
        return True

    pool = UpstreamPool(keepalive=5)
    async with serving(handler) as (url, server):
        assert await (await pool.request(url, "/", b"", [], 1.0)).read() == b"ok 1"
        await wait_until_async(lambda: server.closed == 1, 5,
                               "the pool to drop the connection of the unasked answer")
        assert await (await pool.request(url, "/", b"", [], 1.0)).read() == b"ok 2"
        assert server.connections == 2
    await pool.close()


def test_under_a_uvicorn_whose_cycle_differs_everything_goes_through_asgi(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cycle without the attributes ``uvicorn_cycle`` uses (a future uvicorn, say) is never
    read or written: ``receive`` and ``send`` are used as any ASGI server's; checked once."""
    from gateway.api import uvicorn_cycle

    class Cycle:  # the httptools cycle, less one attribute used
        def send(self) -> None:
            pass

    monkeypatch.setattr(uvicorn_cycle, "HttptoolsCycle", Cycle)
    monkeypatch.setattr(uvicorn_cycle, "_cycle_known", None)
    cycle = Cycle()
    for name in uvicorn_cycle._USED[1:]:
        setattr(cycle, name, None)
    assert uvicorn_cycle.httptools_cycle(cycle.send) is None
    assert uvicorn_cycle._cycle_known is False
    cycle.more_body = False
    monkeypatch.setattr(uvicorn_cycle, "_cycle_known", None)
    assert uvicorn_cycle.httptools_cycle(cycle.send) is cycle  # with them all: used


def test_uvicorn_is_a_release_the_sink_was_checked_against() -> None:
    """``gateway.api.uvicorn_cycle`` reads uvicorn's private cycle state as checked against
    CHECKED_UVICORN; pyproject pins uvicorn to that range. A uvicorn outside it (a pin moved
    without checking) fails here, and the gateway keeps to ASGI under it."""
    import tomllib

    import uvicorn

    from gateway.api import uvicorn_cycle
    from support import ROOT

    low, high = uvicorn_cycle.CHECKED_UVICORN
    pin = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
               ["dependencies"] if d.startswith("uvicorn"))
    assert pin.endswith(f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"), pin
    assert uvicorn_cycle.uvicorn_checked(), f"uvicorn {uvicorn.__version__} was not checked"
