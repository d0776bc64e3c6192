"""The autoscale signal and scale from zero, on simulated replicas behind a real gateway
(docs/autoscaling.md): a request held while the model has no replica and served once one
is added; past the timeout a 503 naming why; replicas removed by the named candidate with
streams in flight, none lost; the signal rising under a load step and falling after it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from pathlib import Path

import httpx
import orjson

from scrape import by_label, metric_sum
from support import gateway_server, sim, wait_until

MODEL = "sim-model"
ADMIN = {"authorization": "Bearer admin-token"}
PACED = ("--profile", "paced", "--ttft-ms", "20", "--itl-ms", "20")


def _config(replicas: list[dict], **autoscale: object) -> dict:
    return {"models": [{"name": MODEL, "replicas": replicas}],
            "admin_token": "admin-token", "health": {"interval": 0.5, "timeout": 2.0},
            "retries": {"max_attempts": 1}, "autoscale": autoscale}


def _complete(gateway: str, priority: int = 0) -> httpx.Response:
    return httpx.post(gateway + "/v1/completions", timeout=60,
                      headers={"x-gateway-priority": str(priority)},
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})


def _stream(gateway: str, max_tokens: int) -> tuple[str, int, bool]:
    """One streamed completion read to its end: (replica, tokens, ended with [DONE])."""
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        events = [e for e in reply.read().split(b"\n\n") if e]
    usage = orjson.loads(events[-2][6:])["usage"]
    return reply.headers["x-gateway-replica"], usage["completion_tokens"], \
        events[-1] == b"data: [DONE]"


def _desired(gateway: str) -> float:
    return metric_sum(gateway, "llm_gateway_desired_replicas", model=MODEL, pool="default")


def test_a_request_for_a_model_scaled_to_zero_waits_for_a_replica_and_is_served(
        tmp_path: Path) -> None:
    config = _config([], scale_from_zero={"timeout": 30})
    with gateway_server(tmp_path, config) as (gateway, _), \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert _desired(gateway) == 0  # nothing offered, nothing wanted
        held = pool.submit(_complete, gateway)
        wait_until(lambda: metric_sum(gateway, "llm_gateway_held_requests", model=MODEL) == 1,
                   10, "the request held")
        # The signal rose at once (KEDA's activation), before any replica exists.
        assert _desired(gateway) > 0
        time.sleep(3)
        assert not held.done()
        with sim("vllm", MODEL, 4096) as url:
            added = httpx.post(gateway + "/admin/replicas", headers=ADMIN, timeout=10,
                               json={"model": MODEL, "url": url})
            assert added.status_code == 201, added.text
            answer = held.result(timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"]
            assert metric_sum(gateway, "llm_gateway_held_requests", model=MODEL) == 0
            # The next request is not held at all.
            assert _complete(gateway).status_code == 200


def test_past_the_timeout_a_503_says_why_and_when_to_retry(tmp_path: Path) -> None:
    config = _config([], scale_from_zero={"timeout": 1.0, "retry_after": 7})
    with gateway_server(tmp_path, config) as (gateway, _):
        answer = _complete(gateway)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "7"
        error = answer.json()["error"]
        assert error["code"] == "scaled_to_zero" and "no replica" in error["message"]
        assert metric_sum(gateway, "llm_gateway_rejections_total", reason="scaled_to_zero") == 1
        assert metric_sum(gateway, "llm_gateway_held_requests", model=MODEL) == 0
        # A TGI client is answered in its own shape, held the same way.
        tgi = httpx.post(gateway + "/generate", timeout=30,
                         json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
        assert tgi.status_code == 503 and tgi.json()["error_type"] == "overloaded"


def test_replicas_that_exist_but_are_down_are_an_outage_not_a_scale_up(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 4096) as url:
        config = _config([{"url": url, "engine": "vllm"}], scale_from_zero={"timeout": 30})
        with gateway_server(tmp_path, config) as (gateway, _):
            httpx.post(url + "/sim/faults", json={"fail_health": True}).raise_for_status()
            wait_until(lambda: httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()[
                "replicas"][0]["state"] == "unhealthy", 10, "the replica marked down")
            started = time.monotonic()
            answer = _complete(gateway)
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "no_replica_available"
            assert time.monotonic() - started < 20  # answered, not held for the timeout


def test_removing_the_named_candidates_loses_no_stream(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(sim("vllm", MODEL, 4096, *PACED)) for _ in range(3)]
        config = _config([{"url": u, "engine": "vllm"} for u in urls],
                         target_in_flight=4, scale_down_after=0)
        gateway, _ = stack.enter_context(gateway_server(tmp_path, config))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # Two long streams (about 4 s each): one replica's worth of demand at 4 a replica.
            streams = [pool.submit(_stream, gateway, 200) for _ in range(2)]
            wait_until(lambda: metric_sum(gateway, "llm_gateway_autoscale_concurrent_requests",
                                          model=MODEL) == 2, 10, "both streams in flight")
            candidates = by_label(gateway, "llm_gateway_scale_down_candidate", "replica",
                                  model=MODEL)
            assert 0 < _desired(gateway) <= 1 and len(candidates) == 2, candidates
            in_flight = {r["name"]: r["in_flight"] for r in httpx.get(
                gateway + "/admin/replicas", headers=ADMIN, timeout=5).json()["replicas"]}
            ranked = sorted(candidates, key=candidates.get)
            # The cheapest first: no replica named before one that owes fewer tokens.
            assert [in_flight[n] for n in ranked] == sorted(in_flight[n] for n in ranked)
            assert set(in_flight) - set(ranked) != set()  # one kept
            for name in ranked:  # the autoscaler honours them: both go, streams or not
                removed = httpx.delete(f"{gateway}/admin/replicas/{name}", headers=ADMIN,
                                       timeout=5)
                assert removed.status_code == 200, removed.text
            # Every stream runs to its end where it was.
            assert [s.result(timeout=60)[1:] for s in streams] == [(200, True)] * 2
            wait_until(lambda: by_label(gateway, "llm_gateway_scale_down_candidate",
                                        "replica", model=MODEL) == {}, 10,
                       "no candidate once the pool is as small as wanted")
            assert _stream(gateway, 5)[1:] == (5, True)  # the one left serves


def test_the_signal_rises_under_a_load_step_and_falls_after_it(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(sim("vllm", MODEL, 4096, *PACED)) for _ in range(2)]
        config = _config([{"url": u, "engine": "vllm"} for u in urls],
                         target_in_flight=2, window=3, scale_down_after=2)
        gateway, _ = stack.enter_context(gateway_server(tmp_path, config))
        # Just started, it asks for the replicas there are until it has seen 2 s; then,
        # with nothing offered, for none.
        wait_until(lambda: _desired(gateway) == 0, 10, "the signal at zero with no load")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(_stream, gateway, 100) for _ in range(8)]  # ~2 s each
            wait_until(lambda: _desired(gateway) >= 4, 10,
                       "8 streams at 2 a replica (and headroom): at least 4 replicas wanted")
            assert all(s.result(timeout=60)[2] for s in streams)
        # It falls with the demand, once the window has emptied and scale_down_after passed
        # (that it waits is the smoother's unit test: here the wait is 2 s).
        wait_until(lambda: _desired(gateway) == 0, 20, "the signal back to zero")
