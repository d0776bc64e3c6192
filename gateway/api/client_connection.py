"""The client's side of a generation request: its body, and noticing that it left.

Under uvicorn's httptools server (what ``llm-gateway serve`` runs) both are read off the
request's cycle, with no task or timer of their own: a body that is already in (the usual
case: the request fits one read) is taken without arming the slow-client timer, and a
disconnect is seen through the event uvicorn sets when the connection is lost. Under any
other ASGI server the same is done through ``receive``: a timer on the body, and a task
that waits for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Callable

from gateway.protocol.errors import InvalidRequest

try:  # uvicorn's httptools protocol: receive/send are methods of the request's cycle
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttptoolsCycle
except ImportError:  # pragma: no cover - uvicorn without httptools
    HttptoolsCycle = None  # type: ignore[assignment,misc]

Receive = Callable

MAX_BODY_BYTES = 32 * 1024 * 1024


class BodyTooLarge(InvalidRequest):
    status = 413
    reason = "body_too_large"


class SlowClient(InvalidRequest):
    """The body did not arrive in time: a client trickling bytes cannot pin a slot."""

    status = 408
    reason = "slow_client"

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g}s")


def httptools_cycle(asgi_callable: Callable) -> "HttptoolsCycle | None":
    """The uvicorn httptools cycle behind ``receive`` or ``send``, if that is the server."""
    cycle = getattr(asgi_callable, "__self__", None)
    return cycle if HttptoolsCycle is not None and type(cycle) is HttptoolsCycle else None


async def read_body(receive: Receive, timeout: float, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body; raises SlowClient if it takes longer than ``timeout``,
    BodyTooLarge past ``limit``, CancelledError if the client disconnects first."""
    cycle = httptools_cycle(receive)
    if cycle is not None and not cycle.more_body and not cycle.disconnected:
        return await _read_body(receive, limit)  # all in already: returns without waiting
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(receive, limit)
    except TimeoutError:
        raise SlowClient(timeout) from None


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class cancel_on_disconnect:  # noqa: N801 - used as a context manager, like asyncio.timeout
    """``async with cancel_on_disconnect(receive) as gone:`` cancels the current task if the
    client disconnects inside the block, and swallows that cancellation at its end; ``gone``
    is set when that happened, so the caller can tell a client that left from any other
    cancellation. Call it once the body has been read."""

    __slots__ = ("receive", "gone", "task", "_event", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = asyncio.Event()
        self._event: _DisconnectEvent | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> asyncio.Event:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        cycle = httptools_cycle(self.receive)
        if cycle is not None:
            self._event = _DisconnectEvent.install(cycle, self._left)
        else:
            self._watcher = asyncio.create_task(self._watch())
        return self.gone

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        if self._event is not None:
            self._event.unwatch()
        if self._watcher is not None:
            self._watcher.cancel()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and self.gone.is_set():
            self.task.uncancel()
            return True
        return False

    def _left(self) -> None:
        if not self.gone.is_set():
            self.gone.set()
            self.task.cancel()

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self._left()


class _DisconnectEvent(asyncio.Event):
    """Takes the place of the cycle's ``message_event``, which uvicorn sets when the
    connection is lost (as well as when body arrives or the response completes): calls back
    once the cycle says the client is gone."""

    def __init__(self, cycle: "HttptoolsCycle", callback: Callable[[], None]) -> None:
        super().__init__()
        self.cycle: HttptoolsCycle | None = cycle
        self.callback: Callable[[], None] | None = callback

    @classmethod
    def install(cls, cycle: "HttptoolsCycle", callback: Callable[[], None]) -> "_DisconnectEvent":
        event = cls(cycle, callback)
        if cycle.message_event.is_set():
            super(_DisconnectEvent, event).set()
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
