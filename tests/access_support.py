"""For the API key tests: a gateway app served by a real uvicorn in a thread of the test
process (so caplog sees its logs, and two apps can share one Redis), and key helpers."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import uvicorn

from gateway.access.secret import hash_secret
from gateway.app import create_app
from gateway.config import load_settings
from support import free_port, server_started, wait_ready, wait_until

MODEL = "sim-model"


def key(name: str, secret: str, **extra: Any) -> dict[str, Any]:
    """One `auth.keys` entry for ``secret``."""
    return {"name": name, "sha256": hash_secret(secret), **extra}


@contextlib.contextmanager
def serving(settings: dict[str, Any]) -> Iterator[str]:
    """The gateway with ``settings`` on a free loopback port; yields its base URL."""
    port = free_port()
    app = create_app(load_settings(None, **settings))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio",
                                           http="httptools", access_log=False,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server_started(server, thread, "the gateway"), 20,
                   "the gateway to start", every=0.01)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
