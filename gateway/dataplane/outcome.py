"""What one attempt came to, and who hears of it.

An attempt is one try of a request on one replica, from its placement to its end: sent,
first token, the end (completed, failed, timed out, cut by the client). The relay fills in
an ``Attempt`` as it goes and tells the ``Outcomes`` twice at most, at its first token and
at its end, never per event. Everything that learns from how requests went listens there,
registered once at wiring: the request metrics, passive outlier detection, the canary's
samples, the output-length estimate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from gateway.protocol.request import GenerationRequest
from gateway.protocol.usage import Usage

if TYPE_CHECKING:
    from gateway.dataplane.placement import Placement
    from gateway.fleet.replica import Replica

# Why an attempt failed, when it did (``Attempt.error``). The replica's fault unless noted.
CONNECT = "connect"          # no connection could be made: nothing reached the replica
TRANSPORT = "transport"      # the connection broke before an answer
TIMEOUT = "timeout"          # no answer (no first token) in time
STREAM_BROKEN = "stream_broken"    # the stream ended early or broke after its first token
STREAM_TIMEOUT = "stream_timeout"  # too long between tokens, or past the total budget
BAD_RESPONSE = "bad_response"      # an answer that could not be translated
HTTP_4XX = "http_4xx"        # the engine refused the request (or is busy: 429): not broken
HTTP_5XX = "http_5xx"


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of ``request`` on ``placement.replica``; times are ``time.perf_counter()``."""

    request: GenerationRequest
    placement: "Placement"
    arrival: float          # when the request reached the gateway
    sent_at: float = 0.0    # when it left for the replica
    first_at: float | None = None  # its first token (streams)
    last_at: float | None = None   # its last token (streams)
    ended_at: float = 0.0
    status: int = 0         # what the client was answered (499: the client left)
    answered: bool = False  # the replica answered 2xx (a body, or a stream's start)
    error: str | None = None  # why it failed (the kinds above), None when it did not
    usage: Usage = field(default_factory=Usage)

    @property
    def replica(self) -> "Replica":
        return self.placement.replica

    @property
    def role(self) -> str:
        return "shadow" if self.request.shadow else "primary"

    @property
    def replica_failed(self) -> bool:
        """The replica failed it (connect, transport, timeout, 5xx, a broken stream)."""
        return self.error is not None and self.error != HTTP_4XX

    @property
    def replica_served(self) -> bool:
        """The replica did its part: a whole answer, or a stream past its first token
        (whoever ended it after)."""
        if self.error is not None:
            return False
        return self.first_at is not None if self.request.stream else self.status < 400

    @property
    def completed(self) -> bool:
        """Served to its end (a stream's last event included)."""
        return self.error is None and 200 <= self.status < 300

    @property
    def decode(self) -> tuple[float, float] | None:
        """Mean seconds between tokens and tokens/s after the first, for streams of 2+
        tokens; None otherwise."""
        generated = self.usage.completion_tokens or 0
        if self.first_at is None or self.last_at is None or generated < 2:
            return None
        seconds = self.last_at - self.first_at
        if seconds <= 0:
            return None
        return seconds / (generated - 1), (generated - 1) / seconds

    def end(self, status: int, error: str | None = None) -> None:
        self.status, self.error, self.ended_at = status, error, time.perf_counter()


class Listener:
    """Hears of attempts: override what you need (both are called once per attempt)."""

    def first_token(self, attempt: Attempt) -> None:
        pass

    def ended(self, attempt: Attempt) -> None:
        pass


class Outcomes:
    """The listeners, told in the order registered."""

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        self.listeners: tuple[Listener, ...] = tuple(listeners)
        self._first = tuple(l for l in self.listeners
                            if type(l).first_token is not Listener.first_token)

    def first_token(self, attempt: Attempt) -> None:
        for listener in self._first:
            listener.first_token(attempt)

    def ended(self, attempt: Attempt) -> None:
        for listener in self.listeners:
            listener.ended(attempt)
