"""Keep-alive connections to the replicas, reused last-in first-out (the warmest first)."""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import urlsplit

from gateway.upstream.connection import StaleConnection, UpstreamConnection
from gateway.upstream.errors import UpstreamConnectError
from gateway.upstream.response import UpstreamResponse


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    host_header: bytes
    tls: bool


class UpstreamPool:
    def __init__(self, keepalive: float, max_per_origin: int = 1024) -> None:
        self.keepalive = keepalive  # seconds an idle connection may wait for its next request
        self.max_per_origin = max_per_origin  # exchanges at once; more wait for a free one
        self._slots: dict[_Origin, asyncio.Semaphore] = {}
        self._origins: dict[str, _Origin] = {}
        self._idle: defaultdict[_Origin, list[UpstreamConnection]] = defaultdict(list)
        self._open: set[UpstreamConnection] = set()
        self._tls: ssl.SSLContext | None = None

    async def request(self, url: str, path: str, body: bytes,
                      headers: Iterable[tuple[bytes, bytes]],
                      connect_timeout: float) -> UpstreamResponse:
        """POST ``body`` to ``url + path``; returns once the answer's headers are in.

        A reused connection that turns out to have been closed by the replica while idle is
        replaced by a fresh one, once, before anything is reported.
        """
        origin = self._origin(url)
        head = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", origin.host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"\r\n", body]
        request = b"".join(head)
        slots = self._slots.get(origin)
        if slots is None:
            slots = self._slots[origin] = asyncio.Semaphore(self.max_per_origin)
        await slots.acquire()
        for attempt in (1, 2):
            try:  # the second attempt never reuses: the other idle ones may be stale too
                connection = ((self._idle_connection(origin) if attempt == 1 else None)
                              or await self._connect(origin, connect_timeout))
            except BaseException:
                slots.release()
                raise
            connection.on_exchange_end = slots.release  # once: the answer ends or breaks
            try:
                return await connection.send(request)
            except StaleConnection:
                if attempt == 2:
                    raise
                await slots.acquire()  # the stale exchange freed its slot
            except BaseException:  # cancelled or timed out while waiting: drop the exchange
                connection.abort()
                raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for connection in list(self._open):
            connection.abort()
        self._idle.clear()

    def _origin(self, url: str) -> _Origin:
        origin = self._origins.get(url)
        if origin is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            host = parts.hostname or "localhost"
            try:
                host_header = parts.netloc.encode("idna")
            except UnicodeError:  # an IPv6 literal, say: already ASCII
                host_header = parts.netloc.encode()
            origin = self._origins[url] = _Origin(host, port, host_header, tls)
        return origin

    def _idle_connection(self, origin: _Origin) -> UpstreamConnection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_allowed = asyncio.get_running_loop().time() - self.keepalive
        while idle:
            connection = idle.pop()
            transport = connection.transport
            if (transport is not None and not transport.is_closing()
                    and connection.idle_since >= oldest_allowed):
                return connection
            connection.abort()  # idle too long: the replica may close it any moment
        return None

    async def _connect(self, origin: _Origin, timeout: float) -> UpstreamConnection:
        loop = asyncio.get_running_loop()

        def idle(connection: UpstreamConnection) -> None:
            connection.idle_since = loop.time()
            self._idle[origin].append(connection)

        def closed(connection: UpstreamConnection) -> None:
            self._open.discard(connection)
            idle = self._idle.get(origin)
            if idle and connection in idle:
                idle.remove(connection)

        if origin.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: UpstreamConnection(idle, closed), origin.host, origin.port,
                    ssl=self._tls if origin.tls else None)
        except TimeoutError:
            raise UpstreamConnectError(f"no connection to {origin.host}:{origin.port} within "
                                       f"{timeout:g}s") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {origin.host}:{origin.port}: "
                                       f"{exc.strerror or exc}") from None
        self._open.add(connection)
        return connection
