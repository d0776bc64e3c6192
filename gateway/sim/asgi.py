"""A minimal raw-ASGI toolkit: the simulator's hot path must cost less than the gateway's.

Starlette would add a few tens of microseconds per request and per streamed chunk; here a
route is a dict lookup and a response is two ``send`` calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import orjson

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

JSON = b"application/json"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class DropConnection(Exception):
    """Raised inside a streaming response to make the server close the socket abruptly."""


class _HideDrops(logging.Filter):
    """uvicorn logs a traceback for every exception; injected drops are not errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, DropConnection)


def quiet_injected_drops() -> None:
    logging.getLogger("uvicorn.error").addFilter(_HideDrops())


class Request:
    __slots__ = ("scope", "receive", "send", "method", "path", "body", "query")

    def __init__(self, scope: dict[str, Any], receive: Receive, send: Send, body: bytes) -> None:
        self.scope, self.receive, self.send, self.body = scope, receive, send, body
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope.get("query_string", b"")


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes = b"", content_type: bytes | None = JSON,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    head = [(b"content-length", b"%d" % len(body))]
    if content_type:
        head.append((b"content-type", content_type))
    if headers:
        head.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, status: int, obj: Any,
                       headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await respond(send, status, orjson.dumps(obj), JSON, headers)


async def start_stream(send: Send, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + (headers or [])})


async def write(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone away (the request body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    async def watch() -> None:
        await wait_disconnect(receive)
        on_disconnect()
    return asyncio.get_running_loop().create_task(watch())
