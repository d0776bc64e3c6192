"""Every use of uvicorn's private httptools request cycle, in one place.

Under ``llm-gateway serve`` (uvicorn's httptools server) ASGI's ``receive`` and ``send`` are
methods of the request's ``RequestResponseCycle``. Three things are read off it, and one
attribute is set, because the ASGI way costs a task, a timer or a coroutine switch per
request or per streamed event:

- the body: already all in (``more_body``, ``disconnected``), so it is taken without arming
  the slow-client timer;
- a disconnect: the cycle's ``message_event`` (which uvicorn sets when the connection is lost)
  is replaced by one that calls back, instead of a task waiting for ``http.disconnect``;
- a stream's chunks: once uvicorn's own ``http.response.start`` has chosen chunked framing,
  each read of the replica's stream is written straight onto the connection's ``transport``,
  its ``flow`` control telling when the client falls behind.

Anything else (a response's start, its end) goes through ``send``. Writing the start and the
first token in one write through the cycle's state was measured against uvicorn's own start
(2026-11-27, three runs): no difference beyond the noise, so it is not done.

Checked against the uvicorn releases in ``CHECKED_UVICORN`` (pyproject.toml pins them); a
cycle without these attributes gets the ASGI way for everything.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

try:  # uvicorn's httptools protocol: receive/send are methods of the request's cycle
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttptoolsCycle
except ImportError:  # pragma: no cover - uvicorn without httptools
    HttptoolsCycle = None  # type: ignore[assignment,misc]

CHECKED_UVICORN = ((0, 29), (0, 55))  # from, up to but not including
_USED = ("more_body", "disconnected", "message_event", "transport", "flow", "chunked_encoding")
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


def chunked_transport(cycle: "HttptoolsCycle") -> tuple[asyncio.Transport, Any] | None:
    """After uvicorn's own response start: the connection's transport and its flow control
    (``write_paused``, ``drain()``) when the response is chunked, else None."""
    if cycle.chunked_encoding is not True:
        return None
    return cycle.transport, cycle.flow


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
