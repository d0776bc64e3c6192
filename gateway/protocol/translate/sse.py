"""Complete SSE events out of upstream reads, which may cut an event anywhere, and the base
of the readers that translate them."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.protocol.errors import UpstreamUnavailable
from gateway.upstream.failure import FailureKind
from gateway.protocol.usage import Usage


class EventSplitter:
    """Yields the ``data:`` payload of each complete event (comments such as TGI's ``:``
    keep-alive are skipped); a partial event waits for the read that ends it."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return []
        self.pending = data[cut + 2:]
        return payloads(data[:cut])

    def rest(self) -> list[bytes]:
        """The payload of a last event the engine did not terminate (end of stream)."""
        tail, self.pending = self.pending, b""
        return payloads(tail) if tail.strip() else []


def payloads(events: bytes) -> list[bytes]:
    if events.startswith(b"data:") and events.find(b"\n") < 0:  # the usual read: one event
        return [events[5:].strip()]
    out = []
    for line in events.split(b"\n"):
        if line.startswith(b"data:"):  # engines write one JSON line per event
            out.append(line[5:].strip())
    return out


class TranslatingReader:
    """What the relay's stream loop reads from a translated stream: ``feed`` turns an upstream
    read into the client's bytes and the number of tokens the engine generated in it; usage,
    token events and whether the stream ended as it must. Subclasses translate the payloads
    of complete events (``_events``)."""

    def __init__(self) -> None:
        self.splitter = EventSplitter()
        self._tail: bytes | None = None
        self.usage = Usage()
        self.token_events = 0
        self.finished = False

    @property
    def pending(self) -> bytes:
        """An event the engine left unterminated at the end of its stream (read once)."""
        if self._tail is None:
            try:
                self._tail = self._events(self.splitter.rest())[0]
            except (ValueError, TypeError, AttributeError, KeyError) as exc:
                raise malformed(exc) from None
        return self._tail

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        try:
            return self._events(self.splitter.feed(chunk))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # incl. bad JSON
            raise malformed(exc) from None

    def _events(self, payloads: list[bytes]) -> tuple[bytes, int]:
        raise NotImplementedError


class ChunkReader(TranslatingReader):
    """A translating reader of an OpenAI engine's stream of JSON chunks: ``[DONE]``, chunks
    after the end, the engine's error event and the token chunks, each to its own method."""

    def _events(self, payloads: list[bytes]) -> tuple[bytes, int]:
        out: list[bytes] = []
        tokens = 0
        for payload in payloads:
            if payload == b"[DONE]":
                if not self.finished:
                    self._done(out)
                continue
            chunk = orjson.loads(payload)
            if self.finished:
                self._after_end(chunk)
                continue
            if "error" in chunk:  # the engine's own error event ends the stream
                error = chunk["error"]
                message = error.get("message") if isinstance(error, dict) else str(error)
                out.append(self._error_event(str(message)))
                self.finished = True
                continue
            tokens += self._chunk(chunk, out)
        self.token_events += tokens
        return b"".join(out), tokens

    def _done(self, out: list[bytes]) -> None:
        """``[DONE]`` came before the stream's end was written: write it."""
        raise NotImplementedError

    def _after_end(self, chunk: dict[str, Any]) -> None:
        """A chunk after the end was written (the usage chunk, say)."""

    def _error_event(self, message: str) -> bytes:
        raise NotImplementedError

    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> int:
        """One chunk's events written to ``out``; the tokens it holds."""
        raise NotImplementedError


def malformed(exc: Exception) -> UpstreamUnavailable:
    """An engine answer that cannot be translated: a broken upstream, reported as such (an
    error event mid-stream; before the first token, a retry elsewhere)."""
    return UpstreamUnavailable(f"the replica's answer could not be translated: "
                               f"{type(exc).__name__}: {exc}", FailureKind.BAD_RESPONSE)
