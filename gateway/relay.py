"""Forward a placed request to its replica, stream the answer back, meter it, release its load.

Same-dialect streams pass through as bytes: each upstream read (however many SSE events it
holds) becomes one write to the client, so events waiting upstream are coalesced and a lone
token goes out at once. After its first token a stream is driven by the upstream
connection's reads (``RelayedStream`` is the connection's body handler): each read is
metered and written to the client's transport in the same callback, with no coroutine
switch per event. Every complete event is forwarded in order, whatever it carries (a
usage chunk the client did not ask for is the one exception); events that carry no token
before the first one (a chat role chunk) wait for it, so a replica that fails before its
first token can still be retried. Events are only parsed where something must be read out
of them (usage, TGI's final details). The lease is released exactly once, when the exchange
ends, whether the request completes, fails, times out or the client leaves.

A request whose replica speaks the other dialect (a TGI client on vLLM, OpenAI completions on
an old TGI) is translated (``gateway.protocol.translate``): its body and route are rewritten,
and its stream goes through the same loop with a translating reader in place of the
pass-through one, so timeouts, retries before the first token, the lease and the metrics
behave the same.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import orjson

from gateway.config import TimeoutsConfig
from gateway.fleet.outlier import OutlierDetector
from gateway.fleet.replica import Replica
from gateway.canary.samples import SampleBook
from gateway.metrics import GatewayMetrics, RequestMetrics, status_class
from gateway.protocol.errors import (Api, GatewayError, UpstreamTimeout, UpstreamUnavailable,
                                     error_from_engine)
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import StreamReader, Translation, plan
from gateway.protocol.usage import Usage
from gateway.router import Placement
from gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamResponse

# Response headers of the engine that are not passed on to the client.
# (Bytes, as raw headers are. Bodies pass through undecoded, so content-encoding
# stays; the server writes its own length, framing, date and server headers.)
_DROPPED_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                              b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                              b"upgrade", b"content-length", b"date", b"server"})


JSON_TYPE = (b"content-type", b"application/json")


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
    stream: "RelayedStream | None" = None  # the rest of a stream, after ``first``
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


def upstream_body(request: GenerationRequest) -> bytes:
    """The client's body, plus a request for the usage chunk on OpenAI streams (token truth).

    Continuous usage stats count only with ``include_usage`` (vLLM, SGLang): a client that
    asked for them alone gets none, so they are not asked for on its behalf either.
    """
    if request.api is Api.OPENAI and request.stream and not request.wants_usage:
        options = {**(request.body.get("stream_options") or {}), "include_usage": True}
        options.pop("continuous_usage_stats", None)
        return orjson.dumps({**request.body, "stream_options": options})
    return request.raw


def _usage_from_json(payload: Any, api: Api) -> Usage:
    if isinstance(payload, list) and payload:  # TGI compat route answers a list
        payload = payload[0]
    if not isinstance(payload, dict):
        return Usage()
    if api is Api.OPENAI:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            return Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
        return Usage()
    details = payload.get("details")
    if isinstance(details, dict):
        return Usage(details.get("input_length"), details.get("generated_tokens"))
    return Usage()


class Relay:
    def __init__(self, pool: UpstreamPool, timeouts: TimeoutsConfig,
                 metrics: GatewayMetrics, outlier: OutlierDetector | None = None,
                 samples: SampleBook | None = None) -> None:
        self.pool = pool
        self.samples = samples  # per-pool request figures for the canary verdict
        self.timeouts = timeouts
        self.metrics = metrics
        self.outlier = outlier

    async def forward(self, request: GenerationRequest, placement: Placement, arrival: float,
                      request_id: str) -> Reply:
        """Send to the replica. Raises GatewayError (lease released) if nothing can be sent
        to the client; its ``retry_kind`` is set when another replica may be tried."""
        replica = placement.replica
        meter = self.metrics.for_replica(replica, request.api,
                                         "shadow" if request.shadow else "primary")
        response: UpstreamResponse | None = None
        content = b""
        try:
            # The other dialect's engine: translated, chosen now that the replica is known.
            translation = plan(request, replica.engine, replica.version, replica.model,
                               placement.model.tokenizer, placement.model.window(replica))
            if translation is None:
                path, body = request.path, upstream_body(request)
            else:
                path, body = translation.path, translation.body
            # Bodies pass through undecoded: ask for them uncompressed (the client may not
            # accept an encoding, and a translated answer is parsed).
            headers = ((b"content-type", b"application/json"),
                       (b"x-request-id", request_id.encode()),
                       (b"accept-encoding", b"identity"))
            meter.overhead.observe(time.perf_counter() - arrival)
            try:
                async with asyncio.timeout(self.timeouts.first_token if request.stream
                                           else self.timeouts.total):
                    response = await self.pool.request(replica.url, path, body, headers,
                                                       self.timeouts.connect)
                    if response.status >= 400 or not request.stream:
                        content = await response.read()
            except TimeoutError:
                self.metrics.upstream_error(replica, "timeout")
                self._failed(replica, request)
                raise UpstreamTimeout(f"replica {replica.name} did not answer in time") from None
            except UpstreamError as exc:
                kind = "connect" if isinstance(exc, UpstreamConnectError) else "transport"
                self.metrics.upstream_error(replica, kind)
                self._failed(replica, request)
                error = UpstreamUnavailable(f"replica {replica.name} failed: {exc}")
                error.retry_kind = kind
                raise error from None
            if response.status >= 400:
                self.metrics.upstream_error(replica, f"http_{status_class(response.status)}")
                error = error_from_engine(response.status, content)
                if translation is not None:
                    translation.engine_error(error)
                if response.status == 429:
                    error.retry_kind = "http_429"  # busy, not broken: no outlier failure
                elif response.status >= 500:
                    error.retry_kind = "http_5xx"
                    self._failed(replica, request)
                raise error
        except BaseException as exc:  # including the client leaving (CancelledError)
            placement.lease.close()
            if response is not None:
                response.close()  # drops the connection: the engine aborts the sequence
            status = exc.status if isinstance(exc, GatewayError) else 499
            meter.requests[status_class(status)].inc()
            if status >= 500 and self.samples is not None:
                self.samples.failed(replica.model, replica.pool)
            raise
        reply_headers = self._headers(response, placement, request_id)
        if not request.stream:
            return self._complete(request, placement, meter, response, content, reply_headers,
                                  arrival, translation)
        reader: StreamReader = (translation.reader() if translation is not None else _EventReader(
            request.api, strip_usage=request.api is Api.OPENAI and not request.wants_usage))
        reply = Reply(response.status, reply_headers)
        stream = RelayedStream(self, request, placement, meter, response, arrival, reader, reply)
        reply.stream = stream
        response.stream(stream)
        try:
            reply.first = await stream.first()  # raises (retryable) if it fails first
        except BaseException:
            stream.close()  # the client left (a failure has closed it already)
            raise
        return reply

    # A shadow copy (canary) never ejects a replica nor clears its failures: its outcome
    # must not change how the primary traffic is served.
    def _failed(self, replica: Replica, request: GenerationRequest) -> None:
        if self.outlier is not None and not request.shadow:
            self.outlier.failure(replica)

    def _succeeded(self, replica: Replica, request: GenerationRequest) -> None:
        if self.outlier is not None and not request.shadow:
            self.outlier.success(replica)

    @staticmethod
    def _headers(response: UpstreamResponse, placement: Placement,
                 request_id: str) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in response.raw_headers if k.lower() not in _DROPPED_HEADERS
                   and not k.lower().startswith(b"x-gateway-") and k.lower() != b"x-request-id"]
        headers += [(b"x-gateway-replica", placement.replica.name.encode()),
                    (b"x-gateway-pool", placement.replica.pool.encode()),
                    (b"x-request-id", request_id.encode())]
        return headers

    def _complete(self, request: GenerationRequest, placement: Placement, meter: RequestMetrics,
                  response: UpstreamResponse, body: bytes,
                  headers: list[tuple[bytes, bytes]], arrival: float,
                  translation: Translation | None) -> Reply:
        placement.lease.close()
        if translation is not None:
            try:
                body, usage, extra = translation.response(body, response.headers)
            except GatewayError as error:  # an answer that cannot be translated: a broken one
                self.metrics.upstream_error(placement.replica, "bad_response")
                self._failed(placement.replica, request)
                meter.requests[status_class(error.status)].inc()
                raise
            self._succeeded(placement.replica, request)
            self._account(meter, usage, arrival, None, None, response.status, placement.replica)
            placement.served(usage.completion_tokens)
            # A body the gateway wrote: JSON, whatever the engine's answer was (a stream).
            headers = [h for h in headers if h[0].lower() != b"content-type"]
            return Reply(response.status, [JSON_TYPE, *headers, *extra], body=body, usage=usage)
        self._succeeded(placement.replica, request)
        try:
            usage = _usage_from_json(orjson.loads(body), request.api)
        except orjson.JSONDecodeError:
            usage = Usage()
        # TGI's /generate reports counts in headers when details are off.
        generated, prompt = (response.headers.get("x-generated-tokens", ""),
                             response.headers.get("x-prompt-tokens", ""))
        if usage.completion_tokens is None and generated.isdigit():
            usage.completion_tokens = int(generated)
        if usage.prompt_tokens is None and prompt.isdigit():
            usage.prompt_tokens = int(prompt)
        self._account(meter, usage, arrival, None, None, response.status, placement.replica)
        placement.served(usage.completion_tokens)
        return Reply(response.status, headers, body=body, usage=usage)

    def _account(self, meter: RequestMetrics, usage: Usage, arrival: float,
                 first_at: float | None, last_at: float | None, status: int,
                 replica: Replica) -> None:
        now = time.perf_counter()
        meter.requests[status_class(status)].inc()
        meter.e2e.observe(now - arrival)
        if usage.prompt_tokens:
            meter.prompt_tokens.inc(usage.prompt_tokens)
        generated = usage.completion_tokens or 0
        if generated:
            meter.generation_tokens.inc(generated)
        itl = tokens_per_s = None
        if first_at is not None and last_at is not None and generated > 1 and last_at > first_at:
            decode = last_at - first_at
            itl, tokens_per_s = decode / (generated - 1), (generated - 1) / decode
            meter.itl.observe(itl)
            meter.tokens_per_second.observe(tokens_per_s)
        if self.samples is not None:
            if status >= 500:
                self.samples.failed(replica.model, replica.pool)
            elif status < 400:
                self.samples.served(replica.model, replica.pool,
                                    None if first_at is None else first_at - arrival, itl,
                                    now - arrival, tokens_per_s)


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

    __slots__ = ("relay", "request", "placement", "lease", "meter", "response", "arrival",
                 "reader", "reply", "held", "backlog", "sink", "taps", "first_at", "last_at",
                 "active_at", "ends_at", "status", "ended", "timeout", "_loop", "_timer",
                 "_first", "_done", "_paused")

    def __init__(self, relay: Relay, request: GenerationRequest, placement: Placement,
                 meter: RequestMetrics, response: UpstreamResponse, arrival: float,
                 reader: StreamReader, reply: Reply) -> None:
        self.relay, self.request, self.placement, self.meter = relay, request, placement, meter
        self.lease = placement.lease  # per read: one object fewer to reach it through
        self.response, self.arrival, self.reader = response, arrival, reader
        self.reply: Reply | None = reply  # given its usage at the end
        self.held = b""  # tokenless events (a chat role chunk) before the first token
        self.backlog: list[bytes] = []  # after the first token, before attach()
        self.sink: Sink | None = None
        self.taps: tuple[Tap, ...] = ()  # the shared empty tuple, read per write
        self.first_at: float | None = None
        self.last_at: float | None = None  # the last token (perf_counter, as ``arrival``)
        self.active_at = time.perf_counter()  # the last read, or the client draining
        self.ends_at = arrival + relay.timeouts.total
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
            self.last_at = self.active_at = now = time.perf_counter()
            self.lease.generated(events)
            if self.first_at is None:
                self._first_token(now, out)
                return
        else:
            self.active_at = time.perf_counter()
            if self.first_at is None:
                self.held += out  # sent with the first token: until then a retry is possible
                return
        if out:
            self._emit(out)

    def on_end(self, error: UpstreamError | None) -> None:
        if self.ended:
            return
        name = self.placement.replica.name
        if error is not None:
            self._broken(UpstreamUnavailable(f"replica {name} stream broke: {error}"))
        elif not self.reader.finished:
            self._broken(UpstreamUnavailable(f"replica {name} ended the stream before it was "
                                             f"complete"))
        else:
            tail, self.held = self.held + self.reader.pending, b""
            if self.first_at is None:  # a stream without tokens goes out whole
                self._first.set_result(tail)
            elif tail:  # a last unterminated event
                self._emit(tail)
            self._finish(200)

    # Inside.

    def _first_token(self, now: float, out: bytes) -> None:
        self.first_at = now
        self.lease.first_token()
        self.meter.ttft.observe(now - self.arrival)
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
            self.active_at = time.perf_counter()  # the wait was the client's
            self.response.resume_reading()

    def _on_timer(self) -> None:
        if self.ended:
            return
        now = time.perf_counter()
        left = self.timeout if self._paused else self._time_left(now)  # paused: the client's
        if left > 0:  # active since it was armed, or waiting for the client
            self._timer = self._loop.call_later(left, self._on_timer)
            return
        self.response.close()
        self.relay.metrics.upstream_error(self.placement.replica, "stream_timeout")
        timeouts = self.relay.timeouts
        self._fail(504, UpstreamTimeout(
            f"replica {self.placement.replica.name} sent no token for {self.timeout:g}s (or "
            f"the request ran past its total {timeouts.total:g}s)"), retry_kind=None)

    def _broken(self, error: UpstreamUnavailable) -> None:
        self.relay.metrics.upstream_error(self.placement.replica, "stream_broken")
        self._fail(502, error, retry_kind="transport")

    def _fail(self, status: int, error: GatewayError, retry_kind: str | None) -> None:
        if self.first_at is None:  # nothing sent yet: a plain error, maybe retried elsewhere
            error.retry_kind = retry_kind
            self._finish(status)
            self._first.set_exception(error)
        else:  # mid-stream: the client hears it as the protocol's error event
            self._emit(error.sse_event(self.request.api))
            self._finish(status)

    def _finish(self, status: int) -> None:
        """Once: release the lease, settle the replica's record, meter the request."""
        self.ended = True
        self.status = status
        self._timer.cancel()
        self.lease.close()
        relay, replica, reader = self.relay, self.placement.replica, self.reader
        if status >= 500:
            relay._failed(replica, self.request)
        elif self.first_at is not None:
            relay._succeeded(replica, self.request)
        if reader.usage.completion_tokens is None:  # engine sent no usage: count events
            reader.usage.completion_tokens = reader.token_events
        reply, self.reply = self.reply, None  # the caller holds it: no cycle back to it
        if reply is not None:
            reply.usage = reader.usage
        relay._account(self.meter, reader.usage, self.arrival, self.first_at, self.last_at,
                       status, replica)
        if status == 200:
            self.placement.served(reader.usage.completion_tokens)
        if not self.response.ended:
            self.response.close()  # cut: the engine sees the disconnect and aborts
        if self.sink is not None:  # else the backlog still holds bytes a tap must read
            self._end_taps(status != 499)
        if self._done is not None and not self._done.done():
            self._done.set_result(None)


# Events that carry no token: the chat role chunk and empty closing deltas (compact JSON,
# as engines write it). They must not count as tokens when an engine sends no usage.
_TOKENLESS = (b'"content":""', b'"content":null', b'"delta":{}', b'"text":""')


def _tokenless_events(out: bytes) -> int:
    return sum(out.count(marker) for marker in _TOKENLESS)


def _stamped(events: bytes, field: bytes) -> bytes:
    """``field`` added at the end of each terminal chunk (one with a finish reason) that has
    no fingerprint: where vLLM writes it when the client asked for no usage."""
    parts = events.split(b"\n\n")
    for i, event in enumerate(parts):
        if (b'"finish_reason":"' in event and b'"system_fingerprint"' not in event
                and event.endswith(b"}")):
            parts[i] = event[:-1] + field + b"}"
    return b"\n\n".join(parts)


class _EventReader:
    """Splits upstream bytes on SSE event boundaries and reads what the gateway needs.

    Only complete events are forwarded (a partial one waits for its end). Events are parsed
    only when they carry usage or TGI's final details, which is once per stream.
    """

    __slots__ = ("api", "strip_usage", "partial", "withheld", "usage", "token_events",
                 "finished")

    def __init__(self, api: Api, strip_usage: bool) -> None:
        self.api = api
        self.strip_usage = strip_usage
        self.partial = b""  # an event not yet complete
        self.withheld = b""  # complete events waiting for the usage chunk (see feed)
        self.usage = Usage()
        self.token_events = 0
        self.finished = False

    @property
    def pending(self) -> bytes:
        """What is left at the end of the stream: events withheld, and an unterminated one."""
        return self.withheld + self.partial

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        """Returns the bytes to forward now and how many token events they hold."""
        if not self.partial and chunk.endswith(b"\n\n"):  # the usual case: whole events
            out = chunk
        else:
            data = self.partial + chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                self.partial = data
                return b"", 0
            cut += 2
            out, self.partial = data[:cut], data[cut:]
        if self.withheld:
            out, self.withheld = self.withheld + out, b""
        if (self.strip_usage and b'"finish_reason":"' in out and b'"usage"' not in out
                and b"[DONE]" not in out):
            # vLLM stamps its system_fingerprint on the terminal chunks only when no usage
            # chunk follows. The gateway asked for one on the client's behalf, so a read
            # that ends a choice waits for the next (the usage chunk follows at once) to
            # learn the fingerprint and put it back where the client would have had it.
            self.withheld = out
            return b"", 0
        # Events are the lines that start with `data:` (JSON strings hold no raw newline,
        # so a token's text cannot fake one).
        events = out.count(b"\ndata:") + out.startswith(b"data:")
        if self.api is Api.OPENAI:
            if b"data: [DONE]\n" in out or b"data:[DONE]\n" in out:
                self.finished = True
                events -= 1
            if b'"usage"' in out and (b'"usage":{' in out or b'"usage": {' in out):
                out, events = self._read_usage(out, events)
            if b'""' in out or b'{}' in out or b'"content":null' in out:
                events -= _tokenless_events(out)
        elif b'"generated_text":"' in out or (b'"details"' in out and (
                b'"details":{' in out or b'"details": {' in out)):
            self._read_tgi_final(out)
        if b'"error"' in out:  # the engine's own error event ends the stream; it is no token
            errors = out.count(b'data: {"error":') + out.count(b'data:{"error":')
            if errors:
                self.finished = True
                events -= errors
        self.token_events += max(events, 0)
        return out, max(events, 0)

    def _read_usage(self, out: bytes, events: int) -> tuple[bytes, int]:
        """Read the last usage in ``out`` (usage is cumulative); drop a usage-only chunk the
        client did not ask for. Only that one event is parsed."""
        at = max(out.rfind(b'"usage":{'), out.rfind(b'"usage": {'))
        start = out.rfind(b"data:", 0, at)
        end = out.find(b"\n\n", at) + 2
        parsed = orjson.loads(out[start + 5:end])
        usage = parsed.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
        if not parsed.get("choices"):  # the usage-only chunk carries no token
            events -= 1
            if self.strip_usage:
                fingerprint = parsed.get("system_fingerprint")
                head = out[:start]
                if isinstance(fingerprint, str):
                    head = _stamped(head, b',"system_fingerprint":' + orjson.dumps(fingerprint))
                out = head + out[end:]
        return out, events

    def _read_tgi_final(self, out: bytes) -> None:
        for event in out.split(b"\n\n"):
            payload = event.partition(b"data:")[2].strip()
            if not payload.startswith(b"{"):
                continue
            parsed = orjson.loads(payload)
            if parsed.get("generated_text") is not None:
                self.finished = True
                self.usage = _usage_from_json(parsed, Api.TGI)
