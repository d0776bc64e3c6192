"""One response from a replica, once its headers are in: read its body whole, or have it
delivered chunk by chunk to a ``BodyHandler`` as each read arrives."""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from gateway.upstream.errors import UpstreamError


class Exchange(Protocol):
    """What a response needs of its connection (``connection.UpstreamConnection``)."""

    body_to: Callable[[bytes], None]

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def abort(self) -> None: ...


class BodyHandler(Protocol):
    """Called from the connection's ``data_received``: must not block, must not raise."""

    def on_body(self, data: bytes) -> None: ...

    def on_end(self, error: UpstreamError | None) -> None:
        """The body is complete (``None``) or the exchange failed; called once."""


class UpstreamResponse:
    __slots__ = ("status", "raw_headers", "_headers", "_connection", "_chunks", "_handler",
                 "_ended", "_error", "_waiter")

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]],
                 connection: Exchange) -> None:
        self.status = status
        self.raw_headers = raw_headers  # as received, names in their case
        self._headers: dict[str, str] | None = None
        self._connection: Exchange | None = connection
        self._chunks: list[bytes] = []  # body received before read() or stream()
        self._handler: BodyHandler | None = None
        self._ended = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Header names lowercased (the last of a repeated name wins)."""
        if self._headers is None:
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                             for k, v in self.raw_headers}
        return self._headers

    @property
    def ended(self) -> bool:
        return self._ended

    async def read(self) -> bytes:
        """The whole body; raises ``UpstreamError`` if the exchange breaks first."""
        if not self._ended:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        return b"".join(self._chunks)

    def stream(self, handler: BodyHandler) -> None:
        """Deliver the body to ``handler`` from now on, what arrived so far first. A handler
        that closes the response meanwhile hears nothing more (not even its end)."""
        self._handler = handler
        if self._connection is not None:  # straight to the handler, from now on
            self._connection.body_to = handler.on_body
        chunks, self._chunks = self._chunks, []
        for chunk in chunks:
            if self._handler is not handler:
                return
            handler.on_body(chunk)
        if self._ended and self._handler is handler:
            self._handler = None
            handler.on_end(self._error)

    def pause_reading(self) -> None:
        """The client is not keeping up: stop reading from the replica (TCP pushes back)."""
        if self._connection is not None:
            self._connection.pause_reading()

    def resume_reading(self) -> None:
        if self._connection is not None:
            self._connection.resume_reading()

    def close(self) -> None:
        """Drop the exchange if it is not over: the replica sees the connection close and
        aborts the request. A complete response's connection is already back in the pool."""
        self._handler = None  # whoever closes has stopped listening
        if not self._ended and self._connection is not None:
            self._connection.body_to = self._body
            self._connection.abort()

    # Called by the connection.

    def _body(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.on_body(data)
        else:
            self._chunks.append(data)

    def _end(self, error: UpstreamError | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._connection = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        handler, self._handler = self._handler, None  # its last call: no cycle left behind
        if handler is not None:
            handler.on_end(error)
