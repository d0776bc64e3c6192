"""Every use of uvicorn's private httptools request cycle, in one place.

Under ``llm-gateway serve`` (uvicorn's httptools server) ASGI's ``receive`` and ``send`` are
methods of the request's ``RequestResponseCycle``. This module reads and sets its state where
the ASGI way costs a task, a timer, a write or a coroutine switch per request or per event:

- the body: already all in (``more_body``, ``disconnected``), so it is taken without arming
  the slow-client timer;
- a disconnect: the cycle's ``message_event`` (which uvicorn sets when the connection is lost)
  is replaced by one that calls back, instead of a task waiting for ``http.disconnect``;
- a response's start: the status line and headers go out in the same write as the whole body
  or a stream's first chunk, with the cycle's state set as uvicorn's own start sets it (one
  write and one client wake-up instead of two: 7-13% less CPU per non-streamed request under
  wrk, measured against uvicorn's own start on 2026-11-27; nothing per streamed event). The
  response ends through ``send``, so keep-alive and pipelining stay uvicorn's;
- a stream's chunks: written straight onto the connection's ``transport``, its ``flow``
  control telling when the client falls behind.

Checked against the uvicorn releases in ``CHECKED_UVICORN`` (pyproject.toml pins them); a
cycle without every attribute used here gets the ASGI way for everything.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

try:  # uvicorn's httptools protocol: receive/send are methods of the request's cycle
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttptoolsCycle
except ImportError:  # pragma: no cover - uvicorn without httptools
    HttptoolsCycle = None  # type: ignore[assignment,misc]
    STATUS_LINE = {}

CHECKED_UVICORN = ((0, 29), (0, 55))  # from, up to but not including
_USED = ("more_body", "disconnected", "message_event", "transport", "flow", "chunked_encoding",
         "response_started", "access_log", "scope", "default_headers", "keep_alive",
         "waiting_for_100_continue", "expected_content_length")
_cycle_known: bool | None = None  # whether this uvicorn's cycle has them all (checked once)


def uvicorn_checked() -> bool:
    """The running uvicorn is one this module was checked against."""
    from uvicorn import __version__
    release = tuple(int(part) for part in __version__.split(".")[:2])
    return CHECKED_UVICORN[0] <= release < CHECKED_UVICORN[1]


def httptools_cycle(asgi_callable: Callable) -> "HttptoolsCycle | None":
    """The uvicorn httptools cycle behind ``receive`` or ``send``, if that is the server and
    its cycle has what this module uses."""
    global _cycle_known
    cycle = getattr(asgi_callable, "__self__", None)
    if HttptoolsCycle is None or type(cycle) is not HttptoolsCycle:
        return None
    if _cycle_known is None:
        _cycle_known = uvicorn_checked() and all(hasattr(cycle, name) for name in _USED)
    return cycle if _cycle_known else None


def body_is_in(cycle: "HttptoolsCycle") -> bool:
    """The whole request body has arrived (``receive`` returns it without waiting)."""
    return not cycle.more_body and not cycle.disconnected


def transport_of(cycle: "HttptoolsCycle") -> tuple[asyncio.Transport, Any]:
    """The connection's transport and its flow control (``write_paused``, ``drain()``)."""
    return cycle.transport, cycle.flow


def chunked_transport(cycle: "HttptoolsCycle") -> tuple[asyncio.Transport, Any] | None:
    """After uvicorn's own response start: ``transport_of`` the cycle when the response is
    chunked, else None."""
    return transport_of(cycle) if cycle.chunked_encoding is True else None


def can_write_head(cycle: "HttptoolsCycle", status: int) -> bool:
    """``write_head`` may start this response: the cases uvicorn's start handles its own way
    (a HEAD, an access log to write, a client not keeping up, one gone, a status it has no
    line for) are left to it."""
    return (status in STATUS_LINE and not cycle.response_started and not cycle.disconnected
            and not cycle.access_log and not cycle.flow.write_paused
            and cycle.scope["method"] != "HEAD")


def write_head(cycle: "HttptoolsCycle", status: int, headers: list[tuple[bytes, bytes]],
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


class DisconnectWatch(asyncio.Event):
    """Takes the place of the cycle's ``message_event``, which uvicorn sets when the
    connection is lost (as well as when body arrives or the response completes): calls back
    once the cycle says the client is gone."""

    def __init__(self, cycle: "HttptoolsCycle", callback: Callable[[], None]) -> None:
        super().__init__()
        self.cycle: HttptoolsCycle | None = cycle
        self.callback: Callable[[], None] | None = callback

    @classmethod
    def install(cls, cycle: "HttptoolsCycle", callback: Callable[[], None]) -> "DisconnectWatch":
        event = cls(cycle, callback)
        if cycle.message_event.is_set():
            super(DisconnectWatch, event).set()
        cycle.message_event = event
        if cycle.disconnected:  # already gone: noticed on the next loop turn, as receive would
            asyncio.get_running_loop().call_soon(event._check)
        return event

    def set(self) -> None:
        super().set()
        self._check()

    def unwatch(self) -> None:
        """No more callback; and no reference back to the cycle, whose event this stays
        (without that cycle, each request's objects wait for the garbage collector)."""
        self.callback = self.cycle = None

    def _check(self) -> None:
        callback, cycle = self.callback, self.cycle
        if callback is not None and cycle is not None and cycle.disconnected:
            self.callback = None
            callback()
