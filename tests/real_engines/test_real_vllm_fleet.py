"""Faults with real engines: a vLLM killed mid-stream (SIGKILL of its process group, as a GPU
fault or an OOM kill looks), its return, and the gateway's own drain on SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engines import Engine, VllmSpec, restart, vllms
from support import StreamInThread, gateway_server

ADMIN = {"authorization": "Bearer real"}


class Stream(StreamInThread):
    """One greedy streamed completion of ``max_tokens`` through the gateway."""

    def __init__(self, gateway: str, max_tokens: int) -> None:
        super().__init__(gateway + "/v1/completions", {
            "model": "tiny", "prompt": "faults", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}, timeout=120)

    @property
    def complete(self) -> bool:
        return (self.status == 200 and self.events[-1] == b"data: [DONE]"
                and not any(b'"error"' in e for e in self.events)
                and b'"finish_reason":"length"' in self.events[-2])


def replicas(gateway: str) -> dict[str, dict]:
    answer = httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"]
    return {r["name"]: r for r in answer}


def wait_until(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[Engine]]:
    with vllms(tiny_model, VllmSpec(), VllmSpec()) as both:
        yield both


def test_sigkill_mid_stream_fails_no_request_that_had_not_started(
        engines: list[Engine], tmp_path: Path) -> None:
    victim, other = engines
    config = {"models": [{"name": "tiny", "replicas": [
        {"url": victim.url, "engine": "vllm", "name": "victim"},
        {"url": other.url, "engine": "vllm", "name": "other"}]}],
        "balancer": "round_robin", "admin_token": "real",
        "health": {"interval": 0.5, "timeout": 10.0},
        "outlier": {"consecutive_failures": 1, "base_ejection": 2.0}}
    with gateway_server(tmp_path, config) as (gateway, _):
        running = [Stream(gateway, 400) for _ in range(8)]
        wait_until(lambda: sum(s.replica == "victim" for s in running) >= 2, 60,
                   "streams on the victim")
        wait_until(lambda: victim.metric("vllm:num_requests_running") >= 1, 30,
                   "the victim to generate")
        victim.kill()
        after = [Stream(gateway, 20) for _ in range(8)]  # sent after the kill
        for s in running + after:
            s.join()
        on_victim = [s for s in running if s.replica == "victim"]
        # Cut mid-stream: a proper error event, never a silent end.
        assert on_victim and all(s.complete or s.ended_with_error_event for s in on_victim)
        assert any(s.ended_with_error_event for s in on_victim)
        # Everything else, and every request that had not started, completes.
        assert all(s.complete for s in running if s.replica != "victim")
        assert all(s.complete and s.replica == "other" for s in after), \
            [(s.status, s.replica, s.events[-2:]) for s in after]
        assert replicas(gateway)["victim"]["state"] in ("ejected", "unhealthy")
        # The engine comes back on its port: the gateway takes it back.
        engines[0] = victim = restart(victim)
        wait_until(lambda: replicas(gateway)["victim"]["state"] == "healthy", 60,
                   "the victim's return")
        served = {Stream(gateway, 8).join().replica for _ in range(6)}
        assert served == {"victim", "other"}
        wait_until(lambda: all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0
                               for r in replicas(gateway).values()), 10, "the ledger to settle")


def test_sigterm_drains_real_streams(engines: list[Engine], tmp_path: Path) -> None:
    config = {"models": [{"name": "tiny", "replicas": [
        {"url": e.url, "engine": "vllm", "name": f"e{i}"} for i, e in enumerate(engines)]}],
        "admin_token": "real", "drain_timeout": 60, "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3}}
    with gateway_server(tmp_path, config) as (gateway, proc):
        streams = [Stream(gateway, 200) for _ in range(6)]
        for s in streams:
            assert s.started.wait(60)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(gateway + "/ready").status_code == 503, 5, "/ready 503")
        refused = httpx.post(gateway + "/v1/completions",
                             json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        for s in streams:
            s.join()
        assert all(s.complete for s in streams), [s.events[-2:] for s in streams]
        # Then it exits by itself (uvicorn ends by re-raising the signal it stopped on).
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
