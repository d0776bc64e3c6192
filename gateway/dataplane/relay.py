"""Forward an attempt to its replica, stream the answer back, release its load.

Every request goes through a ``Translation`` (``gateway.protocol.translate.plan``): passed
through as bytes when client and engine speak the same dialect, translated when they do not.
The relay holds no dialect: it sends the translation's body to its path, reads the answer
through the translation's reader, and meters what any answer has (first token, tokens for
the lease, the end).

After its first token a stream is driven by the upstream connection's reads
(``RelayedStream`` is the connection's body handler): each read is metered and written to
the client's transport in the same callback, with no coroutine switch per event. Events that
carry no token before the first one (a chat role chunk) wait for it, so a replica that fails
before its first token can still be retried. The lease is released exactly once, when the
exchange ends, whether the request completes, fails, times out or the client leaves; how it
went is told once, to the ``Outcomes`` (``gateway.dataplane.outcome``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from gateway.config import TimeoutsConfig
from gateway.dataplane.outcome import Attempt, Outcomes, Prefill, RequestRecord
from gateway.dataplane.placement import Placement
from gateway.dataplane.reply import Reply, Sink, Tap
from gateway.protocol.errors import (GatewayError, UpstreamTimeout, UpstreamUnavailable,
                                     error_from_engine)
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import StreamReader, Translation, plan
from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from gateway.upstream.failure import FailureKind

# Response headers of the engine that are not passed on to the client.
# (Bytes, as raw headers are. Bodies pass through undecoded, so content-encoding
# stays; the server writes its own length, framing, date and server headers.)
_DROPPED_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                              b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                              b"upgrade", b"content-length", b"date", b"server"})


class Relay:
    def __init__(self, pool: UpstreamPool, timeouts: TimeoutsConfig, outcomes: Outcomes,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.outcomes = outcomes
        self.clock = clock  # ``time.perf_counter``, as the edge's arrival times (tests: a fake)

    async def forward(self, request: GenerationRequest, placement: Placement,
                      record: RequestRecord, prefill: Prefill | None = None) -> Reply:
        """Send to the replica, as one more attempt of ``record``. Raises GatewayError (lease
        released) if nothing can be sent to the client; its ``failure`` says whether the
        replica failed it and whether another replica may be tried. ``prefill``: the
        disaggregated prefill whose KV the (decode) replica is to take."""
        attempt = Attempt(request, placement, record.arrival, prefill=prefill)
        record.attempts.append(attempt)
        request_id = record.request_id
        replica = placement.replica
        response: UpstreamResponse | None = None
        content = b""
        try:
            admission = placement.admission
            translation = plan(request, replica.engine, replica.version, placement.name,
                               placement.model.tokenizer, placement.model.window(replica),
                               admission.output_cap, admission.plan)
            path, body = translation.path, translation.body
            if prefill is not None:
                body = replica.profile.decode_body(body, prefill.handoff)
            # Bodies pass through undecoded: ask for them uncompressed (the client may not
            # accept an encoding, and a translated answer is parsed).
            headers = ((b"content-type", b"application/json"),
                       (b"x-request-id", request_id.encode()),
                       (b"accept-encoding", b"identity"))
            attempt.sent_at = self.clock()
            if self.outcomes.sends:  # tracing: the attempt's traceparent
                headers += tuple(self.outcomes.sending(attempt, record))
            try:
                async with asyncio.timeout(self.timeouts.first_token if request.stream
                                           else self.timeouts.total):
                    response = await self.pool.request(replica.url, path, body, headers,
                                                       self.timeouts.connect)
                    if response.status >= 400 or not request.stream:
                        content = await response.read()
            except TimeoutError:
                raise UpstreamTimeout(f"replica {replica.name} did not answer in time") from None
            except UpstreamError as exc:
                raise UpstreamUnavailable(f"replica {replica.name} failed: {exc}",
                                          exc.failure) from None
            if response.status >= 400:
                raise translation.engine_error(error_from_engine(response.status, content))
        except BaseException as exc:  # including the client leaving (CancelledError)
            placement.lease.close()
            if response is not None:
                response.close()  # drops the connection: the engine aborts the sequence
            if isinstance(exc, GatewayError):  # the gateway's own (a plan's 400): no failure
                attempt.end(exc.status, exc.failure)
            else:
                attempt.end(499)
            self.outcomes.ended(attempt)
            raise
        attempt.answered = True
        reply_headers = self._headers(response, placement, request_id)
        if not request.stream:
            return self._complete(attempt, translation, response, content, reply_headers)
        reply = Reply(response.status, reply_headers)
        stream = RelayedStream(self, attempt, response, translation.reader(), reply)
        reply.stream = stream
        response.stream(stream)
        try:
            reply.first = await stream.first()  # raises (retryable) if it fails first
        except BaseException:
            stream.close()  # the client left (a failure has closed it already)
            raise
        return reply

    @staticmethod
    def _headers(response: UpstreamResponse, placement: Placement,
                 request_id: str) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in response.raw_headers if k.lower() not in _DROPPED_HEADERS
                   and not k.lower().startswith(b"x-gateway-") and k.lower() != b"x-request-id"]
        headers += [(b"x-gateway-replica", placement.replica.name.encode()),
                    (b"x-gateway-pool", placement.replica.pool.encode()),
                    (b"x-request-id", request_id.encode())]
        return headers

    def _complete(self, attempt: Attempt, translation: Translation, response: UpstreamResponse,
                  content: bytes, headers: list[tuple[bytes, bytes]]) -> Reply:
        attempt.placement.lease.close()
        try:
            body, usage, replaced = translation.response(content, response.headers)
        except GatewayError as error:  # an answer that cannot be translated: a broken one
            attempt.end(error.status, FailureKind.BAD_RESPONSE)
            self.outcomes.ended(attempt)
            raise
        attempt.usage = usage
        attempt.end(response.status)
        self.outcomes.ended(attempt)
        if replaced:
            names = {name for name, _ in replaced}
            headers = [*replaced, *(h for h in headers if h[0].lower() not in names)]
        return Reply(response.status, headers, body=body, usage=usage)


class RelayedStream:
    """A streamed answer on its way from the replica to the client.

    It is the upstream response's body handler: every read is split into whole events, metered
    (first token, tokens for the lease) and written to the sink in the same call. Until the
    first token nothing is written (``first()`` waits for it, so a replica that fails before
    can be retried); between the first token and ``attach`` reads wait in a backlog. One timer
    per stream enforces the first-token, between-tokens and total timeouts: a read only
    stores when it came (``active_at``); the timer works the deadline out when it fires, and
    re-arms itself if the stream was active since.
    """

    __slots__ = ("relay", "attempt", "request", "lease", "response", "arrival", "reader",
                 "reply", "held", "backlog", "sink", "taps", "first_at", "last_at",
                 "active_at", "ends_at", "status", "ended", "timeout", "_now", "_loop", "_timer",
                 "_first", "_done", "_paused")

    def __init__(self, relay: Relay, attempt: Attempt, response: UpstreamResponse,
                 reader: StreamReader, reply: Reply) -> None:
        self.relay, self.attempt, self.request = relay, attempt, attempt.request
        self.lease = attempt.placement.lease  # per read: one object fewer to reach it through
        self.response, self.arrival, self.reader = response, attempt.arrival, reader
        self.reply: Reply | None = reply  # given its usage at the end
        self.held = b""  # tokenless events (a chat role chunk) before the first token
        self.backlog: list[bytes] = []  # after the first token, before attach()
        self.sink: Sink | None = None
        self.taps: tuple[Tap, ...] = ()  # the shared empty tuple, read per write
        self.first_at: float | None = None
        self.last_at: float | None = None  # the last token (perf_counter, as ``arrival``)
        self._now = relay.clock
        self.active_at = self._now()  # the last read, or the client draining
        self.ends_at = self.arrival + relay.timeouts.total
        self.status = 200
        self.ended = False
        self._loop = asyncio.get_running_loop()
        self.timeout = relay.timeouts.first_token  # between_tokens from the first token on
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
        out, events = self.reader.feed(data)
        if events:
            self.last_at = self.active_at = now = self._now()
            self.lease.generated(events)
            if self.first_at is None:
                self._first_token(now, out)
                return
        else:
            self.active_at = self._now()
            if self.first_at is None:
                self.held += out  # sent with the first token: until then a retry is possible
                return
        if out:
            self._emit(out)

    def on_end(self, error: UpstreamError | None) -> None:
        if self.ended:
            return
        name = self.attempt.replica.name
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

    def _first_token(self, now: float, out: bytes) -> None:
        self.first_at = self.attempt.first_at = now
        self.lease.first_token()
        self.relay.outcomes.first_token(self.attempt)
        # From here on the deadline only moves later (the timer re-arms itself when it fires
        # early); this once it may move earlier: re-arm.
        self.timeout = self.relay.timeouts.between_tokens
        self._timer.cancel()
        self._timer = self._loop.call_later(self._time_left(now), self._on_timer)
        out, self.held = self.held + out, b""
        self._first.set_result(out)

    def _time_left(self, now: float) -> float:
        """Until the deadline: ``timeout`` after the last activity, within the total."""
        return max(min(self.active_at + self.timeout, self.ends_at) - now, 0.0)

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
        if self.ended:
            return
        now = self._now()
        left = self.timeout if self._paused else self._time_left(now)  # paused: the client's
        if left > 0:  # active since it was armed, or waiting for the client
            self._timer = self._loop.call_later(left, self._on_timer)
            return
        self.response.close()
        timeouts = self.relay.timeouts
        self._fail(504, UpstreamTimeout(
            f"replica {self.attempt.replica.name} sent no token for {self.timeout:g}s (or "
            f"the request ran past its total {timeouts.total:g}s)", FailureKind.STREAM_TIMEOUT))

    def _fail(self, status: int, error: GatewayError) -> None:
        if self.first_at is None:  # nothing sent yet: a plain error, maybe retried elsewhere
            self._finish(status, error.failure)
            self._first.set_exception(error)
        else:  # mid-stream: the client hears it as the protocol's error event
            self._emit(error.sse_event(self.request.api))
            self._finish(status, error.failure)

    def _finish(self, status: int, failure: FailureKind | None = None) -> None:
        """Once: release the lease, tell how the attempt went, end the taps."""
        self.ended = True
        self.status = status
        self._timer.cancel()
        self.lease.close()
        reader, attempt = self.reader, self.attempt
        if reader.usage.completion_tokens is None:  # engine sent no usage: count events
            reader.usage.completion_tokens = reader.token_events
        reply, self.reply = self.reply, None  # the caller holds it: no cycle back to it
        if reply is not None:
            reply.usage = reader.usage
        attempt.usage, attempt.last_at = reader.usage, self.last_at
        attempt.end(status, failure)
        self.relay.outcomes.ended(attempt)
        if not self.response.ended:
            self.response.close()  # cut: the engine sees the disconnect and aborts
        if self.sink is not None:  # else the backlog still holds bytes a tap must read
            self._end_taps(status != 499)
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
