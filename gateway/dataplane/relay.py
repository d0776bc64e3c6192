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
from gateway.dataplane.reply import Reply
from gateway.dataplane.relayed_stream import RelayedStream
from gateway.migrate.migrator import Continuable, Migrator, Plan
from gateway.protocol.errors import (GatewayError, UpstreamTimeout, UpstreamUnavailable,
                                     error_from_engine)
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import Translation, plan
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
                 clock: Callable[[], float] = time.perf_counter,
                 migrator: Migrator | None = None) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.outcomes = outcomes
        self.clock = clock  # ``time.perf_counter``, as the edge's arrival times (tests: a fake)
        self.migrator = migrator  # None: a stream that breaks ends with an error event

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
        try:
            admission = placement.admission
            translation = plan(request, replica.engine, replica.version, placement.name,
                               placement.model.tokenizer, placement.model.window(replica),
                               admission.output_cap, admission.plan,
                               admission.cost.prompt_tokens if admission.prompt_tokens_exact
                               else None)
            path, body = translation.path, translation.body
            if prefill is not None:
                body = replica.profile.decode_body(body, prefill.handoff)
            going_on: Plan | None = None
            if request.stream and self.migrator is not None:  # could it go on elsewhere?
                going_on = self.migrator.plan(request, placement, translation)
                if isinstance(going_on, Continuable):
                    body = going_on.ask_ids(body)
            response, content = await self.send(attempt, record, path, body)
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
        reader = translation.reader()
        if isinstance(going_on, Continuable):
            reader = going_on.log(reader)
        stream = RelayedStream(self, attempt, response, reader, reply, record, going_on)
        reply.stream = stream
        response.stream(stream)
        try:
            reply.first = await stream.first()  # raises (retryable) if it fails first
        except BaseException:
            stream.close()  # the client left (a failure has closed it already)
            raise
        return reply

    async def send(self, attempt: Attempt, record: RequestRecord, path: str,
                   body: bytes) -> tuple[UpstreamResponse, bytes]:
        """Send ``body`` to ``path`` of the attempt's replica: the answer once it began (a
        stream) or whole, with an error answer's (4xx/5xx) body read. Raises
        UpstreamUnavailable (UpstreamTimeout) when the replica does not answer (in time);
        the exchange is then dropped, as it is when the caller is cancelled."""
        replica, stream = attempt.replica, attempt.request.stream
        # Bodies pass through undecoded: ask for them uncompressed (the client may not
        # accept an encoding, and a translated answer is parsed).
        headers = ((b"content-type", b"application/json"),
                   (b"x-request-id", record.request_id.encode()),
                   (b"accept-encoding", b"identity"))
        attempt.sent_at = self.clock()
        if self.outcomes.sends:  # tracing: the attempt's traceparent
            headers += tuple(self.outcomes.sending(attempt, record))
        response: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.timeouts.first_token if stream
                                       else self.timeouts.total):
                response = await self.pool.request(replica.url, path, body, headers,
                                                   self.timeouts.connect)
                content = await response.read() if response.status >= 400 or not stream \
                    else b""
                return response, content
        except BaseException as exc:
            if response is not None:
                response.close()  # drops the connection: the engine aborts the sequence
            if isinstance(exc, TimeoutError):
                raise UpstreamTimeout(f"replica {replica.name} did not answer in time") from None
            if isinstance(exc, UpstreamError):
                raise UpstreamUnavailable(f"replica {replica.name} failed: {exc}",
                                          exc.failure) from None
            raise

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
