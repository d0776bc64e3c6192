"""What one attempt and one client request came to, and who hears of it.

An attempt is one try of a request on one replica, from its placement to its end: sent,
first token, the end (completed, failed, timed out, cut by the client). The relay fills in
an ``Attempt`` as it goes and tells the ``Outcomes``, never per event: as it is sent (only
the listeners that add a header there: tracing), at its first token (a stream that got
one), at its end (always, once), and, from the retry loop, when a retry follows it (only a
failure before any byte reached the client: never after a first token). So a listener
hears an attempt once to three times. A disaggregated request's prefills are not attempts
(their answer never reaches the client): each is told once, when it ends (``prefilled``),
and a decode replica that prefills for itself instead is told too (``prefill_skipped``).
Everything that learns from how requests went
listens there, registered once at wiring: the request metrics (retries and queueing
included), passive outlier detection, the canary's samples, the output-length estimate,
where stored Responses live, tracing.

A ``RequestRecord`` is one client request at the HTTP edge, from arrival to its answer,
with its attempts (a retry is one more), the gateway's own refusal if it answered one, and
the answer's usage. The edge tells the listeners when it starts (the access log, tracing)
and when it ends (those, and the request metrics: refusals, per-key counts); with none
registered that costs one check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from gateway.protocol.errors import Api
from gateway.protocol.reasons import Reason
from gateway.protocol.request import GenerationRequest
from gateway.protocol.usage import Usage
from gateway.upstream.failure import FailureKind

if TYPE_CHECKING:
    from gateway.dataplane.placement import Placement
    from gateway.fleet.replica import Replica


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
    error: FailureKind | None = None  # why the replica failed it, None when it did not
    retried: bool = False  # it failed before any byte reached the client; a retry followed
    usage: Usage = field(default_factory=Usage)
    trace: Any = None  # tracing's span of it (None: tracing off)
    prefill: "Prefill | None" = None  # disaggregated: the prefill whose KV it decodes from
    # A stream that broke after its first token (gateway.migrate): why ("disconnect",
    # "error_event", "stall", "timeout"), and, when it did not go on elsewhere, why not.
    broke: str | None = None
    not_continued: str | None = None
    migration: "Migration | None" = None  # it continues a stream another attempt broke

    @property
    def replica(self) -> "Replica":
        return self.placement.replica

    @property
    def role(self) -> str:
        return "shadow" if self.request.shadow else "primary"

    @property
    def replica_failed(self) -> bool:
        """The replica failed it (connect, transport, timeout, 5xx, a broken stream)."""
        return self.error is not None and self.error.replica_fault

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

    def end(self, status: int, error: FailureKind | None = None) -> None:
        self.status, self.error, self.ended_at = status, error, time.perf_counter()


@dataclass(slots=True)
class Migration:
    """What a continuation attempt continues: the attempt whose stream broke, and how many
    of the tokens generated before it the continuation's prompt ends with. ``exact`` until
    it generated other tokens than the client had (sampling; ``gateway.migrate``)."""

    broken: Attempt
    carried: int
    exact: bool = True

    def inexact(self) -> None:
        self.exact = False


@dataclass(slots=True, eq=False)
class Prefill:
    """One prefill of a request on a prefill replica; times are ``time.perf_counter()``."""

    placement: "Placement"  # the prefill replica and the prompt's reservation there
    decode: "Replica"  # the replica it prefills for
    sent_at: float
    ended_at: float = 0.0
    status: int = 0  # the prefill replica's answer (0: none)
    error: FailureKind | None = None  # why it failed (None: it did not)
    handoff: Any = None  # what the decode engine is given (vLLM: kv_transfer_params)

    @property
    def replica(self) -> "Replica":
        return self.placement.replica

    @property
    def seconds(self) -> float:
        return self.ended_at - self.sent_at


@dataclass(frozen=True, slots=True)
class Refusal:
    """The gateway answered the request itself with an error: why (a fixed reason), and the
    model and protocol its metrics count it under (only served names become labels)."""

    reason: Reason
    model: str
    api: Api


@dataclass(slots=True, eq=False)
class RequestRecord:
    """One client request at the HTTP edge, from arrival to the end of its answer. Times are
    ``time.perf_counter()``; ``status`` is what the client was answered (a stream that broke
    after its start was answered 200: its last attempt says how it ended)."""

    request_id: str
    api: Api
    route: str              # the gateway route called, e.g. "/v1/chat/completions"
    arrival: float
    traceparent: bytes | None = None  # the client's W3C trace context, as sent
    tracestate: bytes | None = None
    primary: "RequestRecord | None" = None  # a canary shadow copy's primary request
    request: GenerationRequest | None = None  # None: refused before its body parsed
    model: str | None = None  # the configured model it was admitted to
    key: str | None = None    # the API key's name (never the secret)
    admitted_at: float = 0.0  # admission done (window check, key limits)
    attempts: list[Attempt] = field(default_factory=list)
    status: int = 0
    refusal: Refusal | None = None  # the gateway answered an error itself (None: it did not)
    usage: Usage | None = None  # the answer's, once it ended (None: it got no answer)
    client_left: bool = False
    ended_at: float = 0.0
    trace: Any = None  # tracing's span of it (None: tracing off)
    trace_id: str | None = None  # its trace's id (hex), when tracing started its span

    @property
    def error(self) -> str | None:
        """The gateway's error reason, when it answered one itself."""
        return self.refusal.reason if self.refusal is not None else None

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def queued_for(self) -> float:
        """Seconds waited for a free replica slot, over all attempts."""
        return sum(a.placement.queued_for for a in self.attempts)

    @property
    def retries(self) -> int:
        """Attempts that failed before any byte reached the client and were tried again."""
        return sum(a.retried for a in self.attempts)

    @property
    def first_token_at(self) -> float | None:
        """The client's first token: the first attempt's that had one (retries before it had
        none; a continuation's comes later, gateway.migrate)."""
        return next((a.first_at for a in self.attempts if a.first_at is not None), None)


class Listener:
    """Hears of attempts and of client requests: override what you need (each is called
    at most once per attempt or request; see the module's docstring for when)."""

    def sending(self, attempt: Attempt, record: "RequestRecord") -> tuple[bytes, bytes] | None:
        """The attempt of ``record`` is about to be sent: a header to send with it, if any.
        (An attempt holds no reference to its record: the record holds its attempts, and a
        cycle would leave each request's objects to the garbage collector.)"""
        return None

    def first_token(self, attempt: Attempt) -> None:
        pass

    def ended(self, attempt: Attempt) -> None:
        pass

    def retried(self, attempt: Attempt) -> None:
        """``attempt`` has ended failed (``error``) and the request is tried again elsewhere."""

    def prefilled(self, prefill: Prefill) -> None:
        """A prefill for a decode replica ended (answered, failed, or abandoned)."""

    def prefill_skipped(self, decode: "Placement", reason: str) -> None:
        """The decode replica of ``decode`` prefills the prompt itself: no prefill replica
        was available ("unavailable"), those tried failed ("failed"), or the request needs
        the prompt's own logits ("whole_request")."""

    def request_started(self, record: RequestRecord) -> None:
        pass

    def request_ended(self, record: RequestRecord) -> None:
        pass


def _overriding(listeners: tuple[Listener, ...], name: str) -> tuple[Listener, ...]:
    return tuple(l for l in listeners if getattr(type(l), name) is not getattr(Listener, name))


class Outcomes:
    """The listeners, told in the order registered. ``sends``, ``starts`` and ``ends`` are
    false when nobody listens there, so the data path skips those calls with one check."""

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        self.listeners: tuple[Listener, ...] = tuple(listeners)
        self._first = _overriding(self.listeners, "first_token")
        self._attempt_ended = _overriding(self.listeners, "ended")
        self._retried = _overriding(self.listeners, "retried")
        self._prefilled = _overriding(self.listeners, "prefilled")
        self._skipped = _overriding(self.listeners, "prefill_skipped")
        self._sending = _overriding(self.listeners, "sending")
        self._started = _overriding(self.listeners, "request_started")
        self._ended = _overriding(self.listeners, "request_ended")
        self.sends = bool(self._sending)
        self.starts = bool(self._started)
        self.ends = bool(self._ended)

    def sending(self, attempt: Attempt, record: RequestRecord) -> list[tuple[bytes, bytes]]:
        headers = []
        for listener in self._sending:
            header = listener.sending(attempt, record)
            if header is not None:
                headers.append(header)
        return headers

    def first_token(self, attempt: Attempt) -> None:
        for listener in self._first:
            listener.first_token(attempt)

    def ended(self, attempt: Attempt) -> None:
        for listener in self._attempt_ended:
            listener.ended(attempt)

    def retried(self, attempt: Attempt) -> None:
        for listener in self._retried:
            listener.retried(attempt)

    def prefilled(self, prefill: Prefill) -> None:
        for listener in self._prefilled:
            listener.prefilled(prefill)

    def prefill_skipped(self, decode: "Placement", reason: str) -> None:
        for listener in self._skipped:
            listener.prefill_skipped(decode, reason)

    def request_started(self, record: RequestRecord) -> None:
        for listener in self._started:
            listener.request_started(record)

    def request_ended(self, record: RequestRecord) -> None:
        for listener in self._ended:
            listener.request_ended(record)
