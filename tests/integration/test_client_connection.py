"""The client's side of a generation request (``gateway.api.client_connection``) under real
uvicorn servers: with httptools (the cycle's own state, no task or timer) and with h11 (the
generic path through ``receive``), a disconnect cancels the request and a body that does
not arrive in time is a SlowClient."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.api.client_connection import SlowClient, cancel_on_disconnect, read_body
from support import uvicorn_in_thread, wait_until


class Recorder:
    """An ASGI app that reads the body, then waits inside ``cancel_on_disconnect`` for a
    disconnect; it records what happened to each request."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.inside = 0  # requests that reached cancel_on_disconnect's block

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        try:
            body = await read_body(receive, timeout=0.3)
        except SlowClient:
            self.outcomes.append("slow")
            await send({"type": "http.response.start", "status": 408, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if body == b"answer":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            self.outcomes.append("answered")
            return
        async with cancel_on_disconnect(receive) as gone:
            self.inside += 1
            try:
                await asyncio.sleep(5)  # the request's work, until the client leaves
                self.outcomes.append("not cancelled")
            except asyncio.CancelledError:
                self.outcomes.append("cancelled, gone" if gone.is_set() else "cancelled")
                raise
        self.outcomes.append("swallowed" if gone.is_set() else "left the block")


def post(port: int, body: bytes, length: int | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b"
                 % (len(body) if length is None else length, body))
    return sock


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_leaves_cancels_its_request_and_a_slow_body_is_refused(http: str) -> None:
    app = Recorder()
    with uvicorn_in_thread(app, http=http, lifespan="off") as port:
        with post(port, b"wait") as sock:
            wait_until(lambda: app.inside == 1, 5, "the request inside the block")
        wait_until(lambda: len(app.outcomes) >= 2, 5, "outcome 2")
        assert app.outcomes == ["cancelled, gone", "swallowed"]

        with post(port, b"half", length=100) as sock:  # the rest never comes
            wait_until(lambda: len(app.outcomes) >= 3, 5, "outcome 3")
            assert app.outcomes[2] == "slow"
            assert sock.recv(100).startswith(b"HTTP/1.1 408")

        with post(port, b"answer") as sock:  # a body all in at once, answered in full
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
        wait_until(lambda: len(app.outcomes) >= 4, 5, "outcome 4")
        assert app.outcomes[3] == "answered"
