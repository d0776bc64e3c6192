"""The generation endpoints (OpenAI completions/chat, TGI generate), as plain ASGI apps.

These carry every token, so they skip the framework's per-request layers: read the body,
parse, place, relay, write. One shape for all of them: the protocol only changes the parser
and the error body. A client that disconnects cancels the request at once (streaming or
not), which closes the upstream request so the engine aborts the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Callable

from gateway.protocol.errors import Api, GatewayError, InvalidRequest
from gateway.protocol.request import GenerationRequest

if TYPE_CHECKING:
    from gateway.app import Gateway

Scope = dict
Receive = Callable
Send = Callable

MAX_BODY_BYTES = 32 * 1024 * 1024


class BodyTooLarge(InvalidRequest):
    status = 413
    reason = "body_too_large"

    def tgi_status(self) -> int:
        return 413


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def request_id_of(scope: Scope) -> str:
    for key, value in scope["headers"]:
        if key == b"x-request-id" and 0 < len(value) <= 128:
            return value.decode("latin-1")
    return uuid.uuid4().hex


async def send_body(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


JSON = (b"content-type", b"application/json")


async def send_error(send: Send, error: GatewayError, api: Api, request_id: str) -> None:
    headers = [JSON, (b"x-request-id", request_id.encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send_body(send, error.status_for(api), error.body(api), headers)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[asyncio.Event]:
    """Cancel the current task if the client disconnects inside the block.

    Yields an event that is set when that happened, so the caller can tell a client that
    left from any other cancellation.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield gone
    except asyncio.CancelledError:
        if not gone.is_set():
            raise
        task.uncancel()
    finally:
        watcher.cancel()


class GenerationEndpoint:
    """One generation route: ``parse`` turns the body into a GenerationRequest."""

    def __init__(self, gateway: "Gateway", api: Api,
                 parse: Callable[[bytes], GenerationRequest]) -> None:
        self.gateway = gateway
        self.api = api
        self.parse = parse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.perf_counter()
        gateway = self.gateway
        request_id = request_id_of(scope)
        request: GenerationRequest | None = None
        try:
            if gateway.draining:
                raise GatewayError("the gateway is shutting down", status=503)
            request = self.parse(await read_body(receive))
            placement = gateway.router.place(request)
        except GatewayError as error:
            model_label = self._model_label(request.model if request else None)
            gateway.metrics.reject(model_label, self.api, error.reason)
            await send_error(send, error, self.api, request_id)
            return
        except asyncio.CancelledError:
            return  # the client left before sending its whole body

        async with cancel_on_disconnect(receive):
            try:
                reply = await gateway.relay.forward(request, placement, arrival, request_id)
            except GatewayError as error:
                await send_error(send, error, self.api, request_id)
                return
            if reply.stream is None:
                await send_body(send, reply.status, reply.body, reply.headers)
                return
            await send({"type": "http.response.start", "status": reply.status,
                        "headers": reply.headers})
            try:
                async for chunk in reply.stream:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await reply.stream.aclose()  # type: ignore[attr-defined]

    def _model_label(self, name: str | None) -> str:
        """Only configured names become label values (client input never does)."""
        models = self.gateway.router.models
        if name in models:
            return name  # type: ignore[return-value]
        default = self.gateway.router.default_model
        return default if default is not None and (name is None or self.api is Api.TGI) else "unknown"
