"""An engine that replays a recorded response cut into the writes the request asks for.

The request body carries ``"segmentation": {"recording": NAME, "cuts": [...], "gaps": [...]}``
(the gateway forwards bodies as they are); a translated request, whose body the gateway
rewrites, finds its plan in ``PLANS`` under its ``x-request-id``. The recording's bytes are
written in pieces
ending at each cut, ``gaps[i]`` seconds before piece ``i + 1``, each piece one HTTP chunk,
as a real engine's writes reach the gateway. Probes answer as each engine would, enough for
the gateway's discovery, health checks and scrapes. A real uvicorn server on loopback, run
in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, Iterator

import orjson
import uvicorn

from recorded_streams import RECORDINGS
from support import free_port, server_started, wait_until

WINDOW = 4096
PROBES: dict[str, Any] = {
    "/v1/models": {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": WINDOW}]},
    "/info": {"model_id": "m", "max_total_tokens": WINDOW, "max_input_tokens": WINDOW - 1,
              "max_concurrent_requests": 128},
    "/props": {"default_generation_settings": {"n_ctx": WINDOW}, "total_slots": 4},
}


# Plans of translated requests, by x-request-id (the test and the engine share a process).
PLANS: dict[str, dict[str, Any]] = {}
# A replica URL ending in this is a TGI that reports an old version (no /v1/completions).
OLD_TGI = "/tgi-1.4.3"


class SegmentedEngine:
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        old_tgi = path.startswith(OLD_TGI)
        path = path.removeprefix(OLD_TGI)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            probe = PROBES.get(path)
            if old_tgi and path == "/info":
                probe = {**probe, "version": "1.4.3"}
            status = 200 if probe is not None or path in ("/health", "/metrics") else 404
            payload = orjson.dumps(probe) if probe is not None else b""
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-length", b"%d" % len(payload))]})
            await send({"type": "http.response.body", "body": payload})
            return
        plan = orjson.loads(body).get("segmentation") or PLANS[dict(scope["headers"])[b"x-request-id"].decode()]
        recording = RECORDINGS[plan["recording"]]
        kind = b"text/event-stream" if recording.stream else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        data, cuts = recording.data, plan["cuts"]
        for start, end, gap in zip([0, *cuts], [*cuts, len(data)], [0.0, *plan["gaps"]]):
            if gap:
                await asyncio.sleep(gap)  # pacing: the plan's gap between two segments
            await send({"type": "http.response.body", "body": data[start:end], "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """The engine on a free loopback port until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(SegmentedEngine(), host="127.0.0.1", port=port,
                                           loop="asyncio", http="httptools", lifespan="off",
                                           access_log=False, log_level="warning"))
    thread = threading.Thread(target=server.run, name="segmented-engine", daemon=True)
    thread.start()
    wait_until(lambda: server_started(server, thread, "the segmented engine"), 10,
               "the segmented engine to start", every=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
