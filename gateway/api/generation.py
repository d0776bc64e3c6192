"""The generation endpoints (OpenAI completions/chat, TGI generate), as plain ASGI apps.

These carry every token, so they skip the framework's per-request layers: read the body,
parse, place, relay, write. One shape for all of them: the protocol only changes the parser
and the error body. A client that disconnects cancels the request at once (streaming or
not), which closes the upstream request so the engine aborts the sequence.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

from gateway.api.client_connection import cancel_on_disconnect, read_body
from gateway.api.client_sink import open_stream, send_whole
from gateway.api.intake import (Admitted, Gate, Headers, HeadersTooLarge, admit,
                                model_label_of, new_request_id, read_headers)
from gateway.dataplane.outcome import Outcomes, Refusal, RequestRecord
from gateway.protocol.errors import Api, GatewayError
from gateway.protocol.reasons import PLACEMENT_REFUSALS
from gateway.protocol.request import GenerationRequest

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.dataplane.attempts import Attempts
    from gateway.dataplane.reply import Reply


class Serving(Gate):
    """What the endpoints need of the gateway (``gateway.app.Gateway``)."""

    settings: "Settings"
    attempts: "Attempts"
    outcomes: Outcomes
    active_requests: int


Scope = dict
Receive = Callable
Send = Callable

JSON = (b"content-type", b"application/json")


async def send_error(send: Send, error: GatewayError, api: Api, request_id: str,
                     extra: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006 - not mutated
    headers = [JSON, (b"x-request-id", request_id.encode()), *extra]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send_whole(send, error.status_for(api), headers, error.body(api))


class GenerationEndpoint:
    """One generation route: ``parse`` turns the body into a GenerationRequest; ``local``,
    given an admitted request, answers it without an engine where the gateway can (a body;
    None: an engine answers)."""

    def __init__(self, gateway: Serving, api: Api, route: str,
                 parse: Callable[[bytes], GenerationRequest],
                 local: Callable[[Admitted], bytes | None] | None = None) -> None:
        self.gateway = gateway
        self.api = api
        self.route = route
        self.parse = parse
        self.local = local

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
        try:
            admitted = await admit(gateway, headers,
                                   lambda: read_body(receive, gateway.settings.client_body_timeout),
                                   self.parse, record)
        except GatewayError as error:
            await self._reject(send, error, record)
            return
        except asyncio.CancelledError:
            record.client_left, record.status = True, 499
            return  # the client left before sending its whole body
        request, context, model, grant = (admitted.request, admitted.context, admitted.model,
                                          admitted.grant)
        try:
            answer = self.local(admitted) if self.local is not None else None
        except GatewayError as error:
            grant.settle(None)
            await self._reject(send, error, record)
            return
        if answer is not None:
            record.status = 200
            grant.settle(None)  # no tokens generated: the key's reservation goes back
            await send_whole(send, 200, [JSON, (b"x-request-id", request_id.encode())], answer)
            return
        reply: "Reply | None" = None
        watch = cancel_on_disconnect(receive)
        try:
            async with watch:
                try:
                    reply = await gateway.attempts.serve(request, context, model,
                                                         admitted.admission, record)
                except GatewayError as error:
                    if error.reason in PLACEMENT_REFUSALS:
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
        model_label = model_label_of(self.gateway.admitter, request.model if request else None,
                                     api)
        record.refusal = Refusal(error.reason, model_label, api)  # counted by the listeners
        record.status = error.status_for(api)
        await send_error(send, error, api, record.request_id)

