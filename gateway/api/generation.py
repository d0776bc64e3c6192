"""The generation endpoints (OpenAI completions/chat, TGI generate), as plain ASGI apps.

These carry every token, so they skip the framework's per-request layers: read the body,
parse, place, relay, write. One shape for all of them: the protocol only changes the parser
and the error body. A client that disconnects cancels the request at once (streaming or
not), which closes the upstream request so the engine aborts the sequence.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

from gateway.api.client_connection import cancel_on_disconnect, read_body
from gateway.api.client_sink import open_stream, send_whole
from gateway.balance.pool_split import MAX_POOL_CHARS, POOL_HEADER
from gateway.dataplane.outcome import Outcomes, Refusal, RequestRecord
from gateway.flow.objective import (NO_HEADERS, PRIORITY_HEADER, STRICT_HEADER, TPOT_HEADER,
                                    TTFT_HEADER, ObjectiveHeaders, resolve)
from gateway.protocol.errors import Api, Draining, GatewayError, InvalidRequest
from gateway.protocol.request import (MAX_SESSION_CHARS, NO_CONTEXT, SESSION_HEADER, Context,
                                     GenerationRequest)

if TYPE_CHECKING:
    from gateway.access.control import AccessControl
    from gateway.config import Settings
    from gateway.dataplane.admission import Admitter
    from gateway.dataplane.attempts import Attempts
    from gateway.dataplane.reply import Reply


class Serving(Protocol):
    """What the endpoints need of the gateway (``gateway.app.Gateway``)."""

    settings: "Settings"
    admitter: "Admitter"
    access: "AccessControl"
    attempts: "Attempts"
    outcomes: Outcomes
    draining: bool
    active_requests: int


Scope = dict
Receive = Callable
Send = Callable

MAX_HEADER_BYTES = 64 * 1024


def new_request_id() -> str:
    """32 random hex digits (uuid4's shape; a quarter of its cost, paid per request)."""
    return os.urandom(16).hex()


class HeadersTooLarge(InvalidRequest):
    status = 431
    reason = "headers_too_large"


class Headers(NamedTuple):
    """What the edge reads of a request's headers, in one pass."""

    request_id: str  # the client's ``x-request-id``, or a new one
    session: str | None  # ``x-session-id``
    pool: str | None  # ``x-gateway-pool`` (forced pool)
    authorization: bytes | None
    traceparent: bytes | None  # W3C trace context, for tracing and the access log
    tracestate: bytes | None
    objective: ObjectiveHeaders = NO_HEADERS  # x-gateway-priority, x-slo-*


_OBJECTIVE_HEADERS = {PRIORITY_HEADER: 0, TTFT_HEADER: 1, TPOT_HEADER: 2, STRICT_HEADER: 3}


def read_headers(scope: Scope) -> Headers:
    """One pass over the headers; raises if the header block is too big.

    uvicorn's httptools parser sets no limit of its own, so the check is made here, where
    the request is refused before anything is read or reserved.
    """
    request_id = session = pool = authorization = traceparent = tracestate = None
    objective: list[bytes | None] | None = None
    size = 0
    for key, value in scope["headers"]:
        size += len(key) + len(value)
        if key == b"x-request-id" and 0 < len(value) <= 128:
            # Sent on to the replica as is: printable ASCII only (no header injection).
            text = value.decode("latin-1")
            request_id = text if text.isascii() and text.isprintable() else None
        elif key == SESSION_HEADER and 0 < len(value) <= MAX_SESSION_CHARS:
            session = value.decode("latin-1")
        elif key == POOL_HEADER and value:  # too long names no pool: a 400 then
            pool = value[:MAX_POOL_CHARS + 1].decode("latin-1")
        elif key == b"authorization":
            authorization = value
        elif key == b"traceparent":
            traceparent = value
        elif key == b"tracestate":
            tracestate = value
        elif key in _OBJECTIVE_HEADERS:
            objective = objective or [None] * 4
            objective[_OBJECTIVE_HEADERS[key]] = value
    if size > MAX_HEADER_BYTES:
        raise HeadersTooLarge(f"request headers are larger than {MAX_HEADER_BYTES} bytes")
    return Headers(request_id or new_request_id(), session, pool, authorization, traceparent,
                   tracestate, NO_HEADERS if objective is None else ObjectiveHeaders(*objective))


JSON = (b"content-type", b"application/json")


async def send_error(send: Send, error: GatewayError, api: Api, request_id: str,
                     extra: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006 - not mutated
    headers = [JSON, (b"x-request-id", request_id.encode()), *extra]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send_whole(send, error.status_for(api), headers, error.body(api))


class GenerationEndpoint:
    """One generation route: ``parse`` turns the body into a GenerationRequest."""

    def __init__(self, gateway: Serving, api: Api, route: str,
                 parse: Callable[[bytes], GenerationRequest]) -> None:
        self.gateway = gateway
        self.api = api
        self.route = route
        self.parse = parse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.perf_counter()
        gateway = self.gateway
        outcomes = gateway.outcomes
        headers: Headers | HeadersTooLarge
        try:
            headers = read_headers(scope)
            record = RequestRecord(headers.request_id, self.api, self.route, arrival,
                                   headers.traceparent, headers.tracestate)
        except HeadersTooLarge as error:
            headers, record = error, RequestRecord(new_request_id(), self.api, self.route,
                                                   arrival)
        if outcomes.starts:  # the access log, tracing
            outcomes.request_started(record)
        gateway.active_requests += 1
        try:
            if isinstance(headers, HeadersTooLarge):
                await self._reject(send, headers, record)
            else:
                await self._serve(record, headers, receive, send)
        finally:
            gateway.active_requests -= 1
            if outcomes.ends:  # those, and the request metrics
                record.ended_at = time.perf_counter()
                outcomes.request_ended(record)

    async def _serve(self, record: RequestRecord, headers: Headers, receive: Receive,
                     send: Send) -> None:
        gateway = self.gateway
        request_id = record.request_id
        request: GenerationRequest | None = None
        try:
            if gateway.draining:
                raise Draining()
            # Before the body: 401 early.
            key = gateway.access.authenticate(headers.authorization)
            if key is not None:
                record.key = key.name
            body = await read_body(receive, gateway.settings.client_body_timeout)
            request = record.request = self.parse(body)
            caller = key.caller if key is not None else None
            context = (Context(headers.session, headers.pool, caller)
                       if headers.session or headers.pool or caller else NO_CONTEXT)
            preparing = gateway.admitter.prepare(request)  # an adapter to load, a stored
            if preparing is None:                          # Response's replica, a long count
                model, admission = gateway.admitter.admit(request, context)
            else:
                model, admission = gateway.admitter.admit(request, context, await preparing)
            record.model = model.name
            if headers.objective is not NO_HEADERS or model.objective is not None or \
                    key is not None:  # priority and latency objectives (gateway.flow)
                context = context._replace(objective=resolve(
                    headers.objective, key.objective if key is not None else None,
                    key.priority_ceiling if key is not None else None, model.objective))
            # The key's allowlist and limits; the grant is settled below, however it ends.
            grant = await gateway.access.admit(key, model.name,
                                               admission.cost.prompt_tokens,
                                               admission.cost.output_tokens)
            record.admitted_at = time.perf_counter()
        except GatewayError as error:
            await self._reject(send, error, record)
            return
        except asyncio.CancelledError:
            record.client_left, record.status = True, 499
            return  # the client left before sending its whole body
        reply: "Reply | None" = None
        watch = cancel_on_disconnect(receive)
        try:
            async with watch:
                try:
                    reply = await gateway.attempts.serve(request, context, model, admission,
                                                         record)
                except GatewayError as error:
                    if error.reason in _GATEWAY_REASONS:
                        record.refusal = Refusal(error.reason, model.name, request.api)
                    record.status = error.status_for(request.api)
                    await send_error(send, error, request.api, request_id, grant.headers)
                    return
                record.status = reply.status
                headers_out = reply.headers + grant.headers if grant.headers else reply.headers
                if reply.stream is None:
                    await send_whole(send, reply.status, headers_out, reply.body)
                    return
                sink = None
                try:
                    sink = await open_stream(send, reply.status, headers_out, reply.first)
                    reply.stream.attach(sink)  # the rest goes out as the replica sends it
                    await reply.stream.wait()
                    await sink.finish()
                finally:
                    reply.stream.close()
                    if sink is not None:
                        sink.close()
        finally:
            if watch.gone.is_set():
                record.client_left = True
                record.status = record.status or 499
            record.usage = usage = reply.usage if reply is not None else None
            grant.settle(usage)

    async def _reject(self, send: Send, error: GatewayError, record: RequestRecord) -> None:
        request = record.request
        # The client's protocol: the route's, unless its body said otherwise (/tokenize).
        api = request.api if request is not None else error.api or self.api
        model_label = self._model_label(request.model if request else None, api)
        record.refusal = Refusal(error.reason, model_label, api)  # counted by the listeners
        record.status = error.status_for(api)
        await send_error(send, error, api, record.request_id)

    def _model_label(self, name: str | None, api: Api) -> str:
        """Only served names (configured, or listed by an engine) become label values
        (client input never does)."""
        if name is not None and self.gateway.admitter.names.resolve(name) is not None:
            return name
        default = self.gateway.admitter.default_model
        return default if default is not None and (name is None or api is Api.TGI) else "unknown"


# Errors the gateway answers itself after admission (counted as rejections); the engines'
# own errors are counted as upstream errors by the relay.
_GATEWAY_REASONS = frozenset({"overloaded", "queue_full", "no_replica", "shed",
                              "objective_unattainable"})
