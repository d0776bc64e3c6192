"""What the relay hands back: the reply, and the interfaces a stream is read through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from gateway.protocol.usage import Usage


@dataclass(slots=True)
class Reply:
    """What goes back to the client: a whole body, or a stream of SSE bytes.

    A stream's first bytes (its first token) are read before the reply is returned, so a
    replica that fails before producing anything can still be retried elsewhere.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    first: bytes = b""
    stream: "Stream | None" = None  # the rest of a stream, after ``first``
    usage: Usage | None = None  # the engine's count, known once the body or stream is done


class Sink(Protocol):
    """Where a stream's bytes go after its first token: the client's connection (or a
    canary's shadow reader). ``write`` is called from the upstream read callback."""

    def write(self, data: bytes) -> bool:
        """Send ``data`` on; True while the client is not keeping up (the relay then stops
        reading upstream until ``when_drained`` calls back). One call per upstream read."""

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the client has caught up."""


class Tap(Protocol):
    """Reads a stream as it passes (the canary's primary text)."""

    def feed(self, data: bytes) -> None: ...

    def end(self, ok: bool) -> None: ...


class Stream(Protocol):
    """The rest of a streamed reply (``gateway.dataplane.relayed_stream.RelayedStream``)."""

    def attach(self, sink: Sink) -> None:
        """Forward to ``sink`` from now on, what arrived since the first token first."""

    def tap(self, tap: Tap) -> None:
        """Have ``tap`` read every byte from the next one written on, and hear the end."""

    async def wait(self) -> None:
        """Until the stream has ended."""

    def close(self) -> None:
        """The client is gone (or the caller is done): abort an unfinished stream."""
