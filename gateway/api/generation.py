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
from typing import TYPE_CHECKING, Callable, Protocol

from gateway.api.client_connection import cancel_on_disconnect, read_body
from gateway.api.client_sink import open_stream, send_whole
from gateway.canary.split import MAX_POOL_CHARS, POOL_HEADER
from gateway.protocol.errors import Api, Draining, GatewayError, InvalidRequest
from gateway.protocol.request import MAX_SESSION_CHARS, SESSION_HEADER, GenerationRequest

if TYPE_CHECKING:
    from gateway.access.control import AccessControl
    from gateway.access.keys import ApiKey
    from gateway.config import Settings
    from gateway.dataplane.admission import Admitter
    from gateway.dataplane.attempts import Attempts
    from gateway.dataplane.reply import Reply
    from gateway.metrics import GatewayMetrics


class Serving(Protocol):
    """What the endpoints need of the gateway (``gateway.app.Gateway``)."""

    settings: "Settings"
    admitter: "Admitter"
    access: "AccessControl"
    attempts: "Attempts"
    metrics: "GatewayMetrics"
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


def read_headers(scope: Scope) -> tuple[str, str | None, str | None, bytes | None]:
    """One pass over the headers: the request id (the client's ``x-request-id`` or a new one),
    the client's session (``x-session-id``), forced pool (``x-gateway-pool``) and its
    ``authorization``; raises if the header block is too big.

    uvicorn's httptools parser sets no limit of its own, so the check is made here, where
    the request is refused before anything is read or reserved.
    """
    request_id = session = pool = authorization = None
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
    if size > MAX_HEADER_BYTES:
        raise HeadersTooLarge(f"request headers are larger than {MAX_HEADER_BYTES} bytes")
    return request_id or new_request_id(), session, pool, authorization


JSON = (b"content-type", b"application/json")


async def send_error(send: Send, error: GatewayError, api: Api, request_id: str,
                     extra: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006 - not mutated
    headers = [JSON, (b"x-request-id", request_id.encode()), *extra]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send_whole(send, error.status_for(api), headers, error.body(api))


class GenerationEndpoint:
    """One generation route: ``parse`` turns the body into a GenerationRequest."""

    def __init__(self, gateway: Serving, api: Api,
                 parse: Callable[[bytes], GenerationRequest]) -> None:
        self.gateway = gateway
        self.api = api
        self.parse = parse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.perf_counter()
        gateway = self.gateway
        request: GenerationRequest | None = None
        try:
            request_id, session, pool, authorization = read_headers(scope)
        except HeadersTooLarge as error:
            await self._reject(send, error, None, new_request_id())
            return
        gateway.active_requests += 1
        key = None
        try:
            try:
                if gateway.draining:
                    raise Draining()
                key = gateway.access.authenticate(authorization)  # before the body: 401 early
                body = await read_body(receive, gateway.settings.client_body_timeout)
                request = self.parse(body)
                request.session, request.pool = session, pool
                preparing = gateway.admitter.prepare(request)  # an adapter to load, a
                if preparing is not None:                      # stored Response's replica
                    await preparing
                model, admission = gateway.admitter.admit(request)
                # The key's allowlist and limits; the grant is settled below, however it ends.
                grant = await gateway.access.admit(key, request, model.name,
                                                   admission.cost.prompt_tokens,
                                                   admission.cost.output_tokens)
            except GatewayError as error:
                await self._reject(send, error, request, request_id, key)
                return
            except asyncio.CancelledError:
                return  # the client left before sending its whole body
            reply: "Reply | None" = None
            try:
                async with cancel_on_disconnect(receive):
                    try:
                        reply = await gateway.attempts.serve(request, model, admission,
                                                             arrival, request_id)
                    except GatewayError as error:
                        if error.reason in _GATEWAY_REASONS:
                            gateway.metrics.reject(model.name, request.api, error.reason)
                            if request.caller is not None:
                                gateway.metrics.key_rejected(request.caller.name, model.name,
                                                             error.reason)
                        await send_error(send, error, request.api, request_id, grant.headers)
                        return
                    headers = reply.headers + grant.headers if grant.headers else reply.headers
                    if reply.stream is None:
                        await send_whole(send, reply.status, headers, reply.body)
                        return
                    sink = None
                    try:
                        sink = await open_stream(send, reply.status, headers, reply.first)
                        reply.stream.attach(sink)  # the rest goes out as the replica sends it
                        await reply.stream.wait()
                        await sink.finish()
                    finally:
                        reply.stream.close()
                        if sink is not None:
                            sink.close()
            finally:
                usage = reply.usage if reply is not None else None
                grant.settle(usage)
                if request.caller is not None:
                    gateway.metrics.key_done(request.caller.name, model.name, usage)
        finally:
            gateway.active_requests -= 1

    async def _reject(self, send: Send, error: GatewayError, request: GenerationRequest | None,
                      request_id: str, key: "ApiKey | None" = None) -> None:
        # The client's protocol: the route's, unless its body said otherwise (/tokenize).
        api = request.api if request is not None else error.api or self.api
        model_label = self._model_label(request.model if request else None, api)
        metrics = self.gateway.metrics
        metrics.reject(model_label, api, error.reason)
        if key is not None:
            metrics.key_rejected(key.name, model_label, error.reason)
        elif error.reason == "unauthorized":
            metrics.key_rejected("", model_label, error.reason)
        await send_error(send, error, api, request_id)

    def _model_label(self, name: str | None, api: Api) -> str:
        """Only served names (configured, or listed by an engine) become label values
        (client input never does)."""
        if name is not None and self.gateway.admitter.names.resolve(name) is not None:
            return name
        default = self.gateway.admitter.default_model
        return default if default is not None and (name is None or api is Api.TGI) else "unknown"


# Errors the gateway answers itself after admission (counted as rejections); the engines'
# own errors are counted as upstream errors by the relay.
_GATEWAY_REASONS = frozenset({"overloaded", "queue_full", "no_replica"})
