"""A streamed answer on its way from the replica to the client (``RelayedStream``), after
the relay (``gateway.dataplane.relay``) sent its request and read its first bytes: metered,
written, timed, and continued elsewhere when it breaks (``gateway.migrate``)."""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from gateway.config import TimeoutsConfig
from gateway.dataplane.outcome import Attempt, Outcomes, RequestRecord
from gateway.dataplane.reply import Reply, Sink, Tap
from gateway.migrate.exactness import NotContinued
from gateway.migrate.migrator import Continuable, Migrator, Plan
from gateway.migrate.token_log import StreamBreak, TokenLog
from gateway.protocol.errors import GatewayError, UpstreamTimeout, UpstreamUnavailable
from gateway.protocol.translate import StreamReader
from gateway.protocol.usage import Usage
from gateway.upstream import UpstreamError, UpstreamResponse
from gateway.upstream.failure import FailureKind


class StreamOwner(Protocol):
    """What a stream needs of the relay that started it (``gateway.dataplane.relay.Relay``)."""

    timeouts: TimeoutsConfig
    outcomes: Outcomes
    clock: Callable[[], float]
    migrator: Migrator | None


class RelayedStream:
    """A streamed answer on its way from the replica to the client.

    It is the upstream response's body handler: every read is split into whole events, metered
    (first token, tokens for the lease) and written to the sink in the same call. Until the
    first token nothing is written (``first()`` waits for it, so a replica that fails before
    can be retried); between the first token and ``attach`` reads wait in a backlog. One timer
    per stream enforces the first-token, between-tokens and total timeouts: a read only
    stores when it came (``active_at``); the timer works the deadline out when it fires, and
    re-arms itself if the stream was active since.

    A stream that breaks after its first token (its connection lost or closed early, an error
    event from the engine, a hung engine) goes on on another replica when it can
    (``gateway.migrate``): its attempt ends as its replica's failure, and the continuation's
    answer, a new attempt, is read on into the same reader and sink (``continue_with``). A hung
    engine is told from a slow token by its other streams: the stream and every other stream
    of its replica silent for ``migration.stall_timeout`` (``Replica.streamed_at``).
    """

    __slots__ = ("relay", "attempt", "request", "record", "lease", "response", "replica",
                 "arrival", "reader", "reply", "held", "backlog", "sink", "taps", "first_at",
                 "last_at", "active_at", "ends_at", "status", "ended", "timeout", "stall",
                 "plan", "tried", "carried", "migrating", "broken", "engine_error", "_now",
                 "_loop", "_timer", "_first", "_done", "_paused")

    def __init__(self, relay: StreamOwner, attempt: Attempt, response: UpstreamResponse,
                 reader: StreamReader, reply: Reply, record: RequestRecord | None = None,
                 plan: Plan | None = None) -> None:
        self.relay, self.attempt, self.request = relay, attempt, attempt.request
        self.record = record  # a continuation is one more of its attempts (None: no record)
        self.lease = attempt.placement.lease  # per read: one object fewer to reach it through
        self.replica = attempt.placement.replica
        self.response, self.arrival, self.reader = response, attempt.arrival, reader
        self.reply: Reply | None = reply  # given its usage at the end
        self.held = b""  # tokenless events (a chat role chunk) before the first token
        self.backlog: list[bytes] = []  # after the first token, before attach()
        self.sink: Sink | None = None
        self.taps: tuple[Tap, ...] = ()  # the shared empty tuple, read per write
        self.first_at: float | None = None  # the client's first token
        self.last_at: float | None = None  # the last token (perf_counter, as ``arrival``)
        self._now = relay.clock
        self.active_at = self._now()  # the last read, or the client draining
        self.ends_at = self.arrival + relay.timeouts.total
        self.status = 200
        self.ended = False
        self._loop = asyncio.get_running_loop()
        self.timeout = relay.timeouts.first_token  # between_tokens from the first token on
        # A stream that may go on elsewhere (``plan``) breaks when its replica hangs.
        self.plan = plan  # Continuable, or NotContinued: why it cannot (None: not asked)
        self.stall = relay.migrator.stall_timeout if isinstance(plan, Continuable) \
            and relay.migrator is not None and record is not None else None
        self.tried = [self.replica]  # each replica it ran on
        self.carried = 0  # tokens generated before this attempt (a continuation's)
        self.migrating: asyncio.Future[None] | None = None  # placing and sending a continuation
        self.broken: GatewayError | None = None  # why its last attempt broke (while migrating)
        self.engine_error = b""  # ... and the engine's error event, when it sent one
        self._timer = self._loop.call_later(self._time_left(self.active_at), self._on_timer)
        self._first: asyncio.Future[bytes] = self._loop.create_future()
        self._done: asyncio.Future[None] | None = None
        self._paused = False

    async def first(self) -> bytes:
        """The bytes up to and with the first token (held events first)."""
        return await self._first

    def attach(self, sink: Sink) -> None:
        """Forward to ``sink`` from now on, what arrived since the first token first."""
        self.sink = sink
        backlog, self.backlog = self.backlog, []
        for out in backlog:
            self._emit(out)
        if self.ended:  # it ended before it was attached: its taps hear the end now
            self._end_taps(self.status != 499)

    def tap(self, tap: Tap) -> None:
        """Have ``tap`` read every byte from the next one written on, and hear the end once
        it has read them all (a stream may end before it is attached: then at ``attach``)."""
        self.taps += (tap,)

    def _end_taps(self, ok: bool) -> None:
        taps, self.taps = self.taps, ()
        for tap in taps:
            tap.end(ok)

    async def wait(self) -> None:
        """Until the stream has ended (completed, failed with an error event, or closed)."""
        if not self.ended:
            self._done = self._loop.create_future()
            await self._done

    def close(self) -> None:
        """The client is gone (or the caller is done): abort an unfinished stream upstream,
        so the engine stops generating; its figures count it as a 499."""
        migrating, self.migrating = self.migrating, None
        if migrating is not None:  # its continuation, not yet begun, is given up
            migrating.cancel()
        if not self.ended:
            self.response.close()
            self._finish(499)
        self._end_taps(False)  # never attached: the client got none of it
        if not self._first.done():
            self._first.cancel()

    # The upstream response's body handler.

    def on_body(self, data: bytes) -> None:
        if self.ended:
            return
        try:
            out, events = self.reader.feed(data)
        except StreamBreak as broke:  # the engine's error event (a stream that may go on)
            self._read(broke.out, broke.events)
            self.engine_error = broke.tail
            if self.ended or self.first_at is not None and self._migrate(
                    "error_event", 502, UpstreamUnavailable(
                        f"replica {self.replica.name} sent an error: {broke.message}",
                        FailureKind.STREAM_BROKEN)):
                return
            self.engine_error = b""
            assert isinstance(self.reader, TokenLog)
            out, events = self.reader.release(broke.tail)  # the engine's own error event
        self._read(out, events)

    def on_end(self, error: UpstreamError | None) -> None:
        if self.ended or self.migrating is not None:  # (a broken attempt's: heard already)
            return
        name = self.replica.name
        if error is not None:
            self._fail(502, UpstreamUnavailable(f"replica {name} stream broke: {error}",
                                                FailureKind.STREAM_BROKEN))
        elif not self.reader.finished:
            self._fail(502, UpstreamUnavailable(f"replica {name} ended the stream before it "
                                                f"was complete", FailureKind.STREAM_BROKEN))
        else:
            tail, self.held = self.held + self.reader.pending, b""
            if self.first_at is None:  # a stream without tokens goes out whole
                self._first.set_result(tail)
            elif tail:  # a last unterminated event
                self._emit(tail)
            self._finish(200)

    # Inside.

    def _read(self, out: bytes, events: int) -> None:
        """Meter what one read gave and send it on."""
        if events:
            self.last_at = self.active_at = now = self._now()
            self.replica.streamed_at = now  # its replica is alive (stall detection)
            self.lease.generated(events)
            if self.attempt.first_at is None and self._first_token(now, out):
                return
        else:
            self.active_at = self._now()
            if self.first_at is None:
                self.held += out  # sent with the first token: until then a retry is possible
                return
        if out:
            self._emit(out)

    def _first_token(self, now: float, out: bytes) -> bool:
        """The attempt's first token; True when it went out as the client's first."""
        self.attempt.first_at = now
        self.lease.first_token()
        # From here on the deadline only moves later (the timer re-arms itself when it fires
        # early); this once it may move earlier: re-arm.
        self.timeout = self.relay.timeouts.between_tokens
        self._timer.cancel()
        self._timer = self._loop.call_later(self._time_left(now), self._on_timer)
        if self.first_at is not None:  # a continuation's: the client's came long ago
            return False
        self.first_at = now
        self.relay.outcomes.first_token(self.attempt)
        out, self.held = self.held + out, b""
        self._first.set_result(out)
        return True

    def _time_left(self, now: float) -> float:
        """Until the timer next looks: ``timeout`` after the last activity, within the total
        (or sooner, when a hung replica is watched for)."""
        deadline = min(self.active_at + self.timeout, self.ends_at)
        if self.stall is not None and self.attempt.first_at is not None:
            deadline = min(deadline, max(self.active_at, self.replica.streamed_at) + self.stall)
        return max(deadline - now, 0.0)

    def _emit(self, out: bytes) -> None:
        sink = self.sink
        if sink is None:
            self.backlog.append(out)
            return
        for tap in self.taps:
            tap.feed(out)
        if sink.write(out) and not self._paused:
            self._paused = True
            self.response.pause_reading()
            sink.when_drained(self._resume)

    def _resume(self) -> None:
        self._paused = False
        if not self.ended:
            self.active_at = self._now()  # the wait was the client's
            self.response.resume_reading()

    def _on_timer(self) -> None:
        if self.ended or self.migrating is not None:
            return
        now = self._now()
        if self._paused:  # waiting for the client, not the replica
            self._timer = self._loop.call_later(self.timeout, self._on_timer)
            return
        timeouts = self.relay.timeouts
        name = self.replica.name
        if now >= min(self.active_at + self.timeout, self.ends_at):
            self.response.close()
            self._fail(504, UpstreamTimeout(
                f"replica {name} sent no token for {self.timeout:g}s (or the request ran "
                f"past its total {timeouts.total:g}s)", FailureKind.STREAM_TIMEOUT), "timeout")
        elif self.stall is not None and self.attempt.first_at is not None and \
                now - max(self.active_at, self.replica.streamed_at) >= self.stall:
            self.response.close()  # no stream of its replica moved: the engine hangs
            self._fail(504, UpstreamTimeout(
                f"replica {name} sent nothing on any stream for {self.stall:g}s",
                FailureKind.STREAM_TIMEOUT), "stall")
        else:  # active since it was armed
            self._timer = self._loop.call_later(self._time_left(now), self._on_timer)

    def _fail(self, status: int, error: GatewayError, broke: str = "disconnect") -> None:
        if self.first_at is None:  # nothing sent yet: a plain error, maybe retried elsewhere
            self._finish(status, error.failure)
            self._first.set_exception(error)
        elif not self._migrate(broke, status, error):  # mid-stream: the protocol's error event
            self._emit(error.sse_event(self.request.api))
            self._finish(status, error.failure)

    # Going on elsewhere (gateway.migrate).

    def _migrate(self, broke: str, status: int, error: GatewayError) -> bool:
        """The stream broke after its first token: end this attempt, and go on on another
        replica if it can (False: it cannot; the caller ends it with the error event)."""
        plan, migrator, reader = self.plan, self.relay.migrator, self.reader
        attempt = self.attempt
        attempt.broke = broke
        if not isinstance(plan, Continuable) or migrator is None or self.record is None or \
                not isinstance(reader, TokenLog):
            attempt.not_continued = plan.label if isinstance(plan, NotContinued) else None
            return False
        reader.cut()  # an event the break cut short is no event
        if reader.generation_ended:  # only its last events were lost
            ending = reader.ending()
            if ending is not None:
                self._read(*reader.release(ending))
                self._finish(200)
                return True
        self._end_attempt(status, error.failure)
        self.broken = error
        self.migrating = asyncio.ensure_future(
            migrator.resume(self, reader, plan, attempt, self.tried))
        return True

    def continue_with(self, attempt: Attempt, response: UpstreamResponse) -> None:
        """Read on from ``response``, the continuation ``attempt``'s answer (its reader,
        the ``TokenLog``, makes its events the first replica's)."""
        assert isinstance(self.reader, TokenLog) and attempt.migration is not None
        self.migrating = None
        self.attempt, self.lease, self.response = attempt, attempt.placement.lease, response
        self.replica = attempt.placement.replica
        self.tried.append(self.replica)
        self.carried = attempt.migration.carried
        self.timeout = self.relay.timeouts.first_token  # it prefills the prompt and more
        self.active_at = now = self._now()
        self._timer = self._loop.call_later(self._time_left(now), self._on_timer)
        if self._paused:
            response.pause_reading()
        response.stream(self)

    def not_continued(self, why: NotContinued) -> None:
        """The stream could not go on elsewhere: the client gets the error event (the
        engine's own, when it sent one)."""
        self.migrating = None
        broken, error = self.attempt, self.broken
        broken.not_continued = why.label
        if self.ended or error is None:
            return
        if self.engine_error and isinstance(self.reader, TokenLog):
            self._emit(self.reader.release(self.engine_error, whole=True)[0])
        else:
            error.message += f" (not continued on another replica: {why.label})"
            self._emit(error.sse_event(self.request.api))
        self._end_stream(broken.status or 502)

    def _end_attempt(self, status: int, failure: FailureKind | None = None) -> None:
        """Release the attempt's lease and connection, tell how it went (once)."""
        self._timer.cancel()
        self.lease.close()
        if not self.response.ended:
            self.response.close()  # cut: the engine sees the disconnect and aborts
        attempt, reader = self.attempt, self.reader
        if attempt.ended_at:
            return
        usage = reader.usage
        if isinstance(reader, TokenLog) and (attempt.broke is not None
                                             or attempt.migration is not None):
            usage = self._own_usage(usage, reader, status < 400)
        elif usage.completion_tokens is None:  # engine sent no usage: count events
            usage.completion_tokens = reader.token_events
        attempt.usage, attempt.last_at = usage, self.last_at
        attempt.end(status, failure)
        self.relay.outcomes.ended(attempt)

    def _own_usage(self, usage: Usage, log: TokenLog, whole: bool) -> Usage:
        """What one attempt of a stream that broke did: the first prefilled the prompt, each
        generated its own tokens (the client's usage counts them all once)."""
        generated = usage.completion_tokens if whole and usage.completion_tokens is not None \
            else log.generated_count()
        prompt = log.prompt_count() if self.attempt.migration is None else None
        return Usage(prompt, max(generated - self.carried, 0), usage.finish_reason)

    def _finish(self, status: int, failure: FailureKind | None = None) -> None:
        """Once: release the lease, tell how the attempt went, end the stream."""
        self._end_attempt(status, failure)
        self._end_stream(status)

    def _end_stream(self, status: int) -> None:
        """Once: the client's stream is over; its usage and its taps' end."""
        self.ended = True
        self.status = status
        self._timer.cancel()
        reply, self.reply = self.reply, None  # the caller holds it: no cycle back to it
        if reply is not None:
            reply.usage = self.reader.usage
        if self.sink is not None:  # else the backlog still holds bytes a tap must read
            self._end_taps(status != 499)
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
