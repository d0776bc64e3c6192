"""The client's side of a generation request: its body, and noticing that it left.

Under uvicorn's httptools server (what ``llm-gateway serve`` runs) both are read off the
request's cycle (``gateway.api.uvicorn_cycle``), with no task or timer of their own: a body that is already in (the usual
case: the request fits one read) is taken without arming the slow-client timer, and a
disconnect is seen through the event uvicorn sets when the connection is lost. Under any
other ASGI server the same is done through ``receive``: a timer on the body, and a task
that waits for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Callable

from gateway.api.uvicorn_cycle import DisconnectWatch, body_is_in, httptools_cycle
from gateway.protocol.errors import InvalidRequest
from gateway.protocol.reasons import Reason

Receive = Callable

MAX_BODY_BYTES = 32 * 1024 * 1024


class BodyTooLarge(InvalidRequest):
    status = 413
    reason = Reason.BODY_TOO_LARGE


class SlowClient(InvalidRequest):
    """The body did not arrive in time: a client trickling bytes cannot pin a slot."""

    status = 408
    reason = Reason.SLOW_CLIENT

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g}s")


async def read_body(receive: Receive, timeout: float, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body; raises SlowClient if it takes longer than ``timeout``,
    BodyTooLarge past ``limit``, CancelledError if the client disconnects first."""
    cycle = httptools_cycle(receive)
    if cycle is not None and body_is_in(cycle):
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
        self._event: DisconnectWatch | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> asyncio.Event:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        cycle = httptools_cycle(self.receive)
        if cycle is not None:
            self._event = DisconnectWatch.install(cycle, self._left)
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
