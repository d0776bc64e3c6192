"""What a continuation starts from: the token ids of a stream's prompt and of every token
the engine generated, read off the stream as it passes (vLLM's ``return_token_ids``: the
prompt's ids in the first chunk, each chunk's own after).

``TokenLog`` wraps the stream's reader. The usual read is one chunk with its ids: they are
found with ``bytes.find`` and kept as bytes (parsed only if the stream breaks), and, when the
gateway asked for them on the client's behalf, written back as the ``null`` the engine sends
without the flag: the client gets the bytes it would have had. Any other read (several
chunks, none with ids, an error event) takes the general path: each event with a regular
expression. An error event from the engine breaks the stream there (``StreamBreak``), before
it reaches the reader, so the answer can go on elsewhere; what came before it is read as
usual.

Whether the text went out whole at the break is the migrator's question (``migrator``):
a chunk's text cannot tell which of its tokens the engine held back.

Tests for a byte pattern use ``find``, not ``in``: CPython 3.11's ``bytes in bytes`` first
tries the needle as an int and formats the TypeError it clears (about 1,000 instructions).
"""

from __future__ import annotations

import re
from typing import Callable

import orjson

from gateway.migrate.continuation import Origin
from gateway.protocol.translate import StreamReader
from gateway.protocol.usage import Usage

_IDS = b'"token_ids":['  # not "prompt_token_ids": a quote first
_GENERATED = re.compile(rb'"token_ids":\[([0-9, ]*)\]')
_PROMPT = re.compile(rb'"prompt_token_ids":\[([0-9, ]*)\]')
_ERROR_EVENTS = (b'data: {"error"', b'data:{"error"')
_JOIN_AT = 256  # chunks' ids kept apart before they are joined into one


class StreamBreak(Exception):
    """The engine sent an error event mid-stream. ``out``/``events``: what the reader made of
    the events before it; ``tail``: the error event and all after it, as the engine sent."""

    def __init__(self, out: bytes, events: int, tail: bytes) -> None:
        super().__init__("the engine sent an error event")
        self.out, self.events, self.tail = out, events, tail

    @property
    def message(self) -> str:
        line = self.tail.split(b"\n", 1)[0]
        return line.partition(b"{")[2][:300].decode(errors="replace").rstrip("}")


def parse_ids(lists: list[bytes]) -> list[int]:
    """The ids of ``"token_ids"`` lists as logged (their bytes between the brackets)."""
    joined = b",".join(part for part in lists if part.strip())
    return [int(i) for i in joined.split(b",")] if joined else []


class TokenLog:
    """A ``StreamReader`` that logs the engine's token ids before ``inner`` reads the stream.

    ``strip``: the client did not ask for the ids (the gateway did): they go out as ``null``.
    The reads it returns count the chunks with ids as the engine sent them (a reader may
    hold one back a while: the last, waiting for the usage that follows it)."""

    __slots__ = ("inner", "strip", "prompt", "generated", "last", "head", "partial",
                 "splice", "regenerated", "diverged")

    def __init__(self, inner: StreamReader, strip: bool) -> None:
        self.inner = inner
        self.strip = strip
        self.prompt: bytes | None = None  # the prompt's ids (the first chunk's list)
        # Each chunk's ids, as sent (joined now and then: memory stays about six bytes a
        # token); and the last chunk with ids itself.
        self.generated: list[bytes] = []
        self.last = b""
        self.head = b""  # the stream's first event (its id, object, created and model)
        self.partial = b""  # an event not yet complete
        # While a continuation's events are read: what makes them the first replica's
        # (``continuation.splice``), and the held-back tokens it generates again, dropped
        # as they come; ``diverged`` is called if others come instead (sampling).
        self.splice: Callable[[bytes], bytes] | None = None
        self.regenerated: list[int] = []
        self.diverged: Callable[[], None] | None = None

    # What the relay reads of a reader.

    @property
    def usage(self) -> Usage:
        return self.inner.usage

    @property
    def token_events(self) -> int:
        return self.inner.token_events

    @property
    def finished(self) -> bool:
        return self.inner.finished

    @property
    def pending(self) -> bytes:
        """At the end of a stream: what the reader still holds, and a last event the engine
        did not terminate (read as the reader would have read it)."""
        if self.partial:
            partial, self.partial = self.partial, b""
            return self.inner.feed(self._logged(partial)[0])[0] + self.inner.pending
        return self.inner.pending

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        if self.partial or not chunk.endswith(b"\n\n"):  # whole events only: ids can be cut
            data = self.partial + chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                self.partial = data
                return b"", 0
            chunk, self.partial = data[:cut], data[cut:]
        dropped = 0
        if self.splice is not None:
            chunk = self.splice(chunk)
            if self.regenerated:
                chunk, dropped = self._drop_regenerated(chunk)
        at = chunk.find(_IDS)
        if at >= 0 and self.prompt is not None:
            end = chunk.find(b"]", at)
            # The usual read: one chunk, its ids the last field (`]}]}` and the event's end
            # follow: no other event can).
            if len(chunk) - end <= 8:
                generated = self.generated
                generated.append(chunk[at + 13:end])
                self.last = chunk
                if len(generated) >= _JOIN_AT:  # bounded: one bytes object, not thousands
                    self.generated = [b",".join(i for i in generated if i)]
                if self.strip:
                    chunk = chunk[:at + 12] + b"null" + chunk[end + 1:]
                return self.inner.feed(chunk)[0], 1 + dropped
        if chunk.find(b'{"error"') >= 0:
            at = min((i for i in map(chunk.find, _ERROR_EVENTS) if i >= 0), default=-1)
            if at >= 0:
                out, events = self._read(chunk[:at]) if at else (b"", 0)
                # (An event begun after it stays partial: read on, it completes.)
                raise StreamBreak(out, events + dropped, chunk[at:])
        out, events = self._read(chunk)
        return out, events + dropped

    def _read(self, chunk: bytes) -> tuple[bytes, int]:
        logged, count = self._logged(chunk)
        return self.inner.feed(logged)[0], count

    def _logged(self, chunk: bytes) -> tuple[bytes, int]:
        """The general path: ``chunk`` as the client gets it, each event's ids logged (and
        the prompt's, from the first chunk); how many chunks with ids it holds."""
        if not self.head:
            self.head = chunk[:chunk.find(b"\n")]
        if self.prompt is None and chunk.find(b'"prompt_token_ids":[') >= 0:
            match = _PROMPT.search(chunk)
            if match is not None:
                self.prompt = match.group(1)
                if self.strip:
                    chunk = _PROMPT.sub(b'"prompt_token_ids":null', chunk, 1)
        if chunk.find(_IDS) < 0:
            return chunk, 0
        count = 0
        for event in chunk.split(b"\n\n"):
            found = _GENERATED.findall(event)
            if found:
                count += 1
                self.generated.append(b",".join(found))
                self.last = event
        if self.strip:
            chunk = _GENERATED.sub(b'"token_ids":null', chunk)
        return chunk, count

    # A continuation.

    def continue_from(self, splice: Callable[[bytes], bytes], regenerated: list[int],
                      diverged: Callable[[], None]) -> None:
        """Read a continuation's events from now on: ``splice`` makes them the first
        replica's; ``regenerated``: the held-back tokens it starts by generating again."""
        self.splice, self.regenerated, self.diverged = splice, regenerated, diverged

    def _drop_regenerated(self, chunk: bytes) -> tuple[bytes, int]:
        """``chunk`` without the tokens generated again, and how many were dropped (they are
        still tokens its engine generated: the lease hears of them)."""
        kept, dropped = [], 0
        for event in chunk.split(b"\n\n"):
            if event and self.regenerated and event.find(_IDS) >= 0:
                event, count = self._trimmed(event)
                dropped += count
            if event:
                kept.append(event + b"\n\n")
        return b"".join(kept), dropped

    def _trimmed(self, event: bytes) -> tuple[bytes, int]:
        payload = orjson.loads(event.partition(b"data:")[2])
        choice = payload["choices"][0]
        ids, expected = choice["token_ids"], self.regenerated
        same = 0
        while same < min(len(ids), len(expected)) and ids[same] == expected[same]:
            same += 1
        if same < min(len(ids), len(expected)):  # other tokens: not the ones the client had
            self.regenerated = []
            if self.diverged is not None:
                self.diverged()
        else:
            self.regenerated = expected[same:]
        if same == len(ids):
            return b"", same
        if not same:
            return event, 0
        choice["token_ids"] = ids[same:]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):  # a TGI client's: one entry per token
            for name, values in logprobs.items():
                if isinstance(values, list):
                    logprobs[name] = values[same:]
        return b"data: " + orjson.dumps(payload), same

    def cut(self) -> None:
        """The stream broke: an event it cut short is dropped (never read, never sent)."""
        self.partial = b""

    def release(self, tail: bytes, whole: bool = False) -> tuple[bytes, int]:
        """Read an error event (and what followed) as if nothing had intercepted it: the
        stream is not continued, the client gets the engine's error as it was sent.
        ``whole``: nothing more will come (the connection was closed after the event), so
        the ``[DONE]`` vLLM writes after its error event is added if it had not come."""
        if whole and tail.find(b"[DONE]") < 0:
            tail += b"data: [DONE]\n\n"
        return self.inner.feed(tail)

    # What a break reads.

    def prompt_ids(self) -> list[int] | None:
        return None if self.prompt is None else parse_ids([self.prompt])

    def prompt_count(self) -> int | None:
        return None if self.prompt is None else len(parse_ids([self.prompt]))

    def generated_count(self) -> int:
        return sum(ids.count(b",") + 1 for ids in self.generated if ids.strip())

    def generated_ids(self) -> list[int]:
        return parse_ids(self.generated)

    @property
    def generation_ended(self) -> bool:
        """The engine sent its finish reason: all that a break can have lost is the end."""
        return self.last.find(b'"finish_reason":"') >= 0

    def ending(self) -> bytes | None:
        """The events that end the engine's stream (its usage, ``[DONE]``), as it would have
        sent them, for a stream whose generation ended before it broke; None: unknown."""
        prompt = self.prompt_count()
        try:
            origin = Origin.of(self.head)
        except ValueError:
            return None
        if prompt is None:
            return None
        return origin.usage_event(prompt, self.generated_count()) + b"data: [DONE]\n\n"
