"""A served request leaves no reference cycle behind: what it allocated (its stream, reply,
upstream response, lease, timer, futures) is freed by reference counting when it ends, so
the garbage collector never has to find the gateway's own objects and pause the event loop
for them. (Before, about 40 objects per request waited for it.)

The gateway runs in this process (uvicorn with httptools, as ``serve`` runs it) in front of
a simulated replica, so the collector can be asked what it found."""

from __future__ import annotations

import collections
import gc
import json
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.config import load_settings
from otlp_receiver import OtlpReceiver
from support import sim, uvicorn_in_thread, wait_until


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "traced-and-logged"])
def test_served_requests_leave_no_garbage_cycles(tmp_path: Path, observed: bool) -> None:
    with sim("vllm", "m") as replica, OtlpReceiver() as otlp:
        config = tmp_path / "gateway.yaml"
        observe = {"tracing": {"enabled": True, "endpoint": otlp.url},
                   "access_log": {"enabled": True, "path": str(tmp_path / "access.log")}}
        config.write_text(json.dumps({"models": [{"name": "m", "replicas": [
            {"url": replica, "engine": "vllm"}]}], **(observe if observed else {})}))
        app = create_app(load_settings(str(config)))
        with uvicorn_in_thread(app, loop="uvloop", http="httptools") as port, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for stream in (False, True):  # warm up: first-use caches are not garbage
                client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                     "max_tokens": 4, "stream": stream})
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector finds, to look at
            try:
                answers = []
                for i in range(10):
                    answers.append(client.post("/v1/completions", json={
                        "model": "m", "prompt": f"request {i}", "max_tokens": 8,
                        "stream": i % 2 == 0}))
                    answers.append(client.post("/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 8, "stream": i % 2 == 1}))
                    answers.append(client.post("/generate_stream", json={
                        "inputs": "hi", "parameters": {"max_new_tokens": 8}}))
                answers.append(client.post("/v1/completions", json={"prompt": 1}))  # a 400
                # every exchange over, connections back in the pool
                wait_until(lambda: app.state.gateway.active_requests == 0, 5,
                           "no request inside the gateway")
                gc.collect()
                ours = collections.Counter(type(o).__qualname__ for o in gc.garbage
                                           if type(o).__module__.startswith("gateway."))
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert [a.status_code for a in answers] == [200] * 30 + [400]
    assert b"data:" in answers[0].content  # streams did stream
    assert ours == {}, f"request objects left in reference cycles: {dict(ours)}"
