"""One keep-alive HTTP/1.1 connection to a replica: writes a request, parses the response
with llhttp (httptools) as bytes arrive, and hands the body on from ``data_received``."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import httptools

from gateway.upstream.errors import UpstreamError, UpstreamTransportError
from gateway.upstream.response import UpstreamResponse

log = logging.getLogger("gateway.upstream")


def _discard(body: bytes) -> None:
    pass


class StaleConnection(UpstreamTransportError):
    """A reused connection closed before any byte of the answer: the replica had dropped it
    while idle, so the request can be sent again on a fresh one."""


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, on_idle: Callable[["UpstreamConnection"], None],
                 on_closed: Callable[["UpstreamConnection"], None]) -> None:
        self._on_idle = on_idle  # the pool takes it back
        self._on_closed = on_closed
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._until_close = False  # a body without length or chunking ends with the connection
        self._received = False  # any byte of the current answer
        self._waiter: asyncio.Future[UpstreamResponse] | None = None
        self._paused = False
        self.on_exchange_end: Callable[[], None] | None = None  # frees the pool's slot
        self.body_to: Callable[[bytes], None] = _discard  # where the current body goes

    # Used by the pool and the response.

    def send(self, request: bytes) -> "asyncio.Future[UpstreamResponse]":
        """Write the request; the future resolves once the answer's headers are in."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._received = False
        self.transport.write(request)
        return self._waiter

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close now; an unfinished exchange ends with an error."""
        self._fail(UpstreamTransportError("exchange aborted by the gateway"))
        if self.transport is not None:
            self.transport.abort()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # our handler raised: a bug, logged
            log.error("upstream body handler failed", exc_info=exc.__context__ or exc)
            self.abort()
        except httptools.HttpParserError as exc:
            self._fail(UpstreamTransportError(f"invalid HTTP from the replica: {exc}"))
            self.transport.abort()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_closed(self)
        response = self.response
        if response is not None and self._until_close:
            self.response = None
            self._exchange_over()
            response._end(None)
        elif self._waiter is not None and not self._received and self.reused:
            self._fail(StaleConnection("the replica closed an idle connection"))
        else:
            reason = f": {exc}" if exc else ""
            self._fail(UpstreamTransportError(f"the replica closed the connection{reason}"))
        self.transport = None

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer; the real one follows
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():  # nobody asked (an idle connection's 408, say)
            if self.transport is not None:
                self.transport.abort()
            return
        self.response = response = UpstreamResponse(status, self._headers, self)
        self.body_to = response._body  # the response hands this on to its body handler
        self._until_close = not any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self._headers
        ) and status not in (204, 304)
        waiter.set_result(response)

    def on_body(self, body: bytes) -> None:
        self.body_to(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is None:
            return  # the end of an interim answer
        self._until_close = False
        self.body_to = _discard
        self._exchange_over()
        if self.parser.should_keep_alive():
            self.resume_reading()
            self.reused = True
            self._on_idle(self)
        elif self.transport is not None:
            self.transport.close()
        response._end(None)

    def _exchange_over(self) -> None:
        release, self.on_exchange_end = self.on_exchange_end, None
        if release is not None:
            release()

    def _fail(self, error: UpstreamError) -> None:
        self._exchange_over()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response, self.response = self.response, None
        if response is not None:
            response._end(error)
