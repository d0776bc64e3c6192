"""Faults end to end: killed and stalled replicas, retries, drain on SIGTERM, backpressure,
the admin API and slow clients. Real gateway processes in front of simulated replicas."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from scrape import metric_sum
from support import (StreamInThread, gateway_server, sim, sim_process,
                     wait_until)

MODEL = "sim-model"
TOKEN = "admin-secret"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def config(replicas: list[dict], **settings: object) -> dict:
    return {"models": [{"name": MODEL, "replicas": replicas}],
            "health": {"interval": 0.3, "timeout": 1.0}, "admin_token": TOKEN, **settings}


def replicas_of(gw: str) -> dict[str, dict]:
    return {r["name"]: r for r in httpx.get(gw + "/admin/replicas", headers=ADMIN).json()["replicas"]}


def settled(gw: str) -> None:
    """Every replica back to zero load, nothing queued, no request inside the gateway."""
    def idle() -> bool:
        runtime = httpx.get(gw + "/admin/runtime", headers=ADMIN).json()
        loads = replicas_of(gw).values()
        return (runtime["active_requests"] == 0 and not any(runtime["queued"].values())
                and all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in loads))
    wait_until(idle, 5, "the gateway to settle")


class Stream(StreamInThread):
    """One streamed request to the gateway, OpenAI's or TGI's."""

    def __init__(self, gw: str, max_tokens: int = 30, api: str = "openai") -> None:
        self.max_tokens, self.api = max_tokens, api
        if api == "openai":
            path, body = "/v1/completions", {"model": MODEL, "prompt": "hello",
                                             "max_tokens": max_tokens, "stream": True}
        else:
            path, body = "/generate_stream", {"inputs": "hello",
                                              "parameters": {"max_new_tokens": max_tokens}}
        super().__init__(gw + path, body, timeout=30)

    @property
    def complete(self) -> bool:
        if self.api == "openai":
            return (self.status == 200 and self.events[-1] == b"data: [DONE]"
                    and len(self.events) == self.max_tokens + 1
                    and not any(b'"error"' in e for e in self.events))
        return self.status == 200 and b'"generated_text"' in self.events[-1]


PACED = ("--profile", "paced", "--ttft-ms", "250", "--itl-ms", "20")


@pytest.mark.parametrize("migration", [True, False], ids=["migration", "no-migration"])
def test_killed_replica_waiting_requests_retry_elsewhere_streams_go_on_or_end_with_error(
        tmp_path: Path, migration: bool) -> None:
    """Requests still waiting for their first token are retried elsewhere; streams under way
    go on on another replica (gateway.migrate), or, with migration off, end with an error
    event: never a silent cut."""
    with sim_process(*PACED) as (a, victim), sim(
            "vllm", MODEL, 4096, *PACED) as b, sim("vllm", MODEL, 4096, *PACED) as c:
        reps = [{"url": a, "engine": "vllm", "name": "victim"},
                {"url": b, "engine": "vllm", "name": "b"}, {"url": c, "engine": "vllm", "name": "c"}]
        settings = config(reps, balancer="round_robin", migration={"enabled": migration})
        with gateway_server(tmp_path, settings) as (gw, _):
            # Streams take ~0.85 s, the first token 0.25 s: the kill finds some of the
            # victim's requests streaming and some still waiting for their first token.
            started = time.monotonic()
            streams = [Stream(gw) for _ in range(6)]
            wait_until(lambda: any(s.replica == "victim" for s in streams), 10, "a stream")
            streams += [Stream(gw) for _ in range(6)]
            time.sleep(0.1)  # the scenario: the kill comes while these are in flight
            victim.kill()
            streams += [Stream(gw) for _ in range(6)]  # sent after the kill
            for s in streams:
                s.join()
            elapsed = time.monotonic() - started
            on_victim = [s for s in streams if s.replica == "victim"]
            elsewhere = [s for s in streams if s.replica != "victim"]
            assert all(s.complete for s in elsewhere), [s.events[-2:] for s in elsewhere]
            if migration:  # every stream cut by the kill went on elsewhere
                assert all(s.complete for s in on_victim), [s.events[-2:] for s in on_victim]
                assert metric_sum(gw, "llm_gateway_migrations_total") >= 1, \
                    "no stream was running on the killed replica"
            else:  # cut by it: a proper error event, never silence
                assert all(s.complete or s.ended_with_error_event for s in on_victim), \
                    [s.events[-2:] for s in on_victim]
                assert any(s.ended_with_error_event for s in on_victim), \
                    "no stream was running on the killed replica"
            retried = metric_sum(gw, "llm_gateway_retries_total")
            assert retried >= 1, "no waiting request was retried on another replica"
            assert elapsed < 30
            settled(gw)


def test_stalled_replica_times_out_is_ejected_and_readmitted(tmp_path: Path) -> None:
    fast = ("--profile", "paced", "--ttft-ms", "1", "--itl-ms", "5")
    with sim("vllm", MODEL, 4096, *fast, "--stall-after", "3") as staller, \
            sim("vllm", MODEL, 4096, *fast) as good:
        reps = [{"url": staller, "engine": "vllm", "name": "staller"},
                {"url": good, "engine": "vllm", "name": "good"}]
        # A stream that cannot go on elsewhere (migration off here: gateway.migrate).
        settings = dict(balancer="round_robin", timeouts={"between_tokens": 0.5},
                        outlier={"consecutive_failures": 1, "base_ejection": 1.5},
                        migration={"enabled": False})
        with gateway_server(tmp_path, config(reps, **settings)) as (gw, _):
            for _ in range(2):  # round robin: one of two lands on the staller
                s = Stream(gw, max_tokens=10).join()
                if s.replica == "staller":
                    break
            assert s.replica == "staller" and s.ended_with_error_event
            assert b"sent no token for 0.5s" in s.events[-2]
            assert replicas_of(gw)["staller"]["state"] == "ejected"
            assert {Stream(gw, 10).join().replica for _ in range(4)} == {"good"}
            httpx.post(staller + "/sim/faults", json={"stall_after": None})
            wait_until(lambda: replicas_of(gw)["staller"]["state"] == "healthy", 10,
                       "re-admission")
            served = [Stream(gw, 10).join() for _ in range(4)]
            assert all(s.complete for s in served)
            assert "staller" in {s.replica for s in served}
            settled(gw)


def test_stream_past_its_total_budget_ends_with_a_timeout_event(tmp_path: Path) -> None:
    """A replica that keeps streaming, each token well within ``between_tokens``, is cut at
    the request's ``total`` budget: the client hears the error event, the engine is cut."""
    steady = ("--profile", "paced", "--ttft-ms", "1", "--itl-ms", "100")  # 60 tokens: 6 s
    with sim("vllm", MODEL, 4096, *steady) as replica:
        settings = dict(timeouts={"between_tokens": 0.5, "total": 1.5})
        with gateway_server(tmp_path, config([{"url": replica, "engine": "vllm"}],
                                             **settings)) as (gw, _):
            s = Stream(gw, max_tokens=60).join()
            assert s.ended_with_error_event, s.events[-2:]
            assert b"ran past its total 1.5s" in s.events[-2]
            tokens = len(s.events) - 2  # the error event and [DONE]
            assert 1 <= tokens <= 16, tokens  # paced at 100 ms: 15 at most by 1.5 s
            settled(gw)
            running = "vllm:num_requests_running"
            assert running + "{" in httpx.get(replica + "/metrics").text
            wait_until(lambda: metric_sum(replica, running) == 0, 2,  # not at the end, 4.5 s on
                       "the engine to drop the request")


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(tmp_path: Path) -> None:
    slow = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "30")
    with sim("vllm", MODEL, 4096, *slow) as a, sim("tgi", MODEL, 4096, *slow) as b:
        reps = [{"url": a, "engine": "vllm", "name": "a"}, {"url": b, "engine": "tgi", "name": "b"}]
        with gateway_server(tmp_path, config(reps, drain_timeout=20)) as (gw, proc):
            # 120 tokens at 30 ms: the drain lasts seconds, time for the refusals below on a
            # loaded machine too (once the streams end the gateway exits).
            streams = [Stream(gw, 120) for _ in range(6)] + [Stream(gw, 120, "tgi") for _ in range(2)]
            for s in streams:
                assert s.started.wait(10)
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(gw + "/ready").status_code == 503, 3, "/ready 503")
            refused = httpx.post(gw + "/v1/completions",
                                 json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            tgi_refused = httpx.post(gw + "/generate", json={"inputs": "x"})
            assert tgi_refused.status_code == 503 and "error_type" in tgi_refused.json()
            for s in streams:
                s.join()
            assert all(s.complete for s in streams), [s.events[-1:] for s in streams]
            proc.wait(timeout=10)  # then it exits by itself


def test_in_flight_limit_queues_then_answers_429(tmp_path: Path) -> None:
    slow = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "20")
    with sim("tgi", MODEL, 4096, *slow, "--max-concurrent-requests", "2") as tgi:
        reps = [{"url": tgi, "engine": "tgi", "name": "tgi"}]
        settings = dict(backpressure={"queue_size": 2, "queue_timeout": 5})
        with gateway_server(tmp_path, config(reps, **settings)) as (gw, _):
            assert replicas_of(gw)["tgi"]["max_concurrent_requests"] == 2  # from /info
            running_now = [Stream(gw, 150, "tgi") for _ in range(2)]  # ~3 s: slots stay full
            for s in running_now:
                assert s.started.wait(5)
            queued = [Stream(gw, 5, "tgi") for _ in range(2)]
            wait_until(lambda: httpx.get(gw + "/admin/runtime", headers=ADMIN)
                       .json()["queued"][MODEL] == 2, 5, "two queued requests")
            over = httpx.post(gw + "/generate", json={"inputs": "x"})
            assert over.status_code == 429
            assert over.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            over = httpx.post(gw + "/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert over.status_code == 429 and over.headers["retry-after"] == "1"
            assert over.json()["error"]["code"] == "overloaded"
            for s in running_now + queued:
                assert s.join().complete  # the queued ones ran once slots freed; none got 429
            assert metric_sum(gw, "llm_gateway_queue_time_seconds_count") == 2
            assert metric_sum(gw, "llm_gateway_rejections_total", api="openai",
                              model="sim-model", reason="overloaded") == 1
            settled(gw)


def test_admin_api_drains_removes_and_adds_replicas_without_cutting_streams(
        tmp_path: Path) -> None:
    slow = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "20")
    with sim("vllm", MODEL, 4096, *slow) as a, sim("vllm", MODEL, 4096, *slow) as b, \
            sim("vllm", MODEL, 4096, *slow) as c:
        reps = [{"url": a, "engine": "vllm", "name": "a"}, {"url": b, "engine": "vllm", "name": "b"}]
        with gateway_server(tmp_path, config(reps, balancer="round_robin")) as (gw, _):
            assert httpx.get(gw + "/admin/replicas").status_code == 401
            assert httpx.get(gw + "/admin/replicas",
                             headers={"authorization": "Bearer wrong"}).status_code == 401
            streams = [Stream(gw, 40) for _ in range(4)]
            for s in streams:
                assert s.started.wait(5)
            drained = httpx.post(gw + "/admin/replicas/a/drain", headers=ADMIN).json()
            assert drained["state"] == "draining" and drained["in_flight"] == 2
            assert {Stream(gw, 2).join().replica for _ in range(4)} == {"b"}
            removed = httpx.delete(gw + "/admin/replicas/b", headers=ADMIN)
            assert removed.status_code == 200 and set(replicas_of(gw)) == {"a"}
            added = httpx.post(gw + "/admin/replicas", headers=ADMIN,
                               json={"model": MODEL, "url": c, "name": "c"})
            assert added.status_code == 201 and added.json()["max_model_len"] == 4096
            assert {Stream(gw, 2).join().replica for _ in range(4)} == {"c"}
            assert httpx.post(gw + "/admin/replicas/a/undrain", headers=ADMIN).json()["state"] \
                == "healthy"
            assert {Stream(gw, 2).join().replica for _ in range(4)} == {"a", "c"}
            for s in streams:
                assert s.join().complete  # drained and removed replicas finished their streams
            bad = httpx.post(gw + "/admin/replicas", headers=ADMIN, json={"model": MODEL})
            assert bad.status_code == 422
            assert httpx.delete(gw + "/admin/replicas/nope", headers=ADMIN).status_code == 404
            settled(gw)


def test_admin_api_is_absent_without_a_token(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 4096) as a:
        cfg = config([{"url": a, "engine": "vllm"}])
        cfg.pop("admin_token")
        with gateway_server(tmp_path, cfg) as (gw, _):
            assert httpx.get(gw + "/admin/replicas", headers=ADMIN).status_code == 404


def test_slow_client_body_gets_408_and_frees_its_slot(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 4096) as a:
        with gateway_server(tmp_path, config([{"url": a, "engine": "vllm"}],
                                             client_body_timeout=0.5)) as (gw, _):
            port = int(gw.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{")
                started = time.monotonic()
                answer = b""
                with contextlib.suppress(OSError):
                    for _ in range(20):  # one byte every 0.1 s: never done within 0.5 s
                        conn.sendall(b" ")
                        time.sleep(0.1)  # the thing tested: a slow client's pace
                        conn.setblocking(False)
                        with contextlib.suppress(BlockingIOError):
                            answer += conn.recv(65536)
                        conn.setblocking(True)
                        if answer:
                            break
                assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
                assert time.monotonic() - started < 3
            settled(gw)
