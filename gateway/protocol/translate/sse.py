"""Complete SSE events out of upstream reads, which may cut an event anywhere."""

from __future__ import annotations


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
    out = []
    for line in events.split(b"\n"):
        if line.startswith(b"data:"):  # engines write one JSON line per event
            out.append(line[5:].strip())
    return out
