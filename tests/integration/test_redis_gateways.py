"""Two real gateway processes sharing load through a real Redis, in front of the same
simulated replicas: one sees and avoids what the other sent; a SIGKILLed instance leaves no
phantom load; Redis killed and restarted mid-run fails no request; all ends at exactly zero.

Bounds under test (defaults: redis_sync_interval 0.1 s, redis_peer_ttl 1.0 s): a peer's new
request is seen within a few ms (announced), at worst ~2 intervals; a killed peer's load is
gone within ttl + interval. Waits below are generous multiples (a shared 2-core machine), and
the measured times (polling /metrics included) are printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
import redis
import yaml

from gateway.balance.redis_ledger import parse_load
from redis_support import SHARED_URL, delete_prefix, private_redis, unique_prefix
from scrape import samples
from support import ROOT, free_port, running, sim, wait_ready, wait_until

MODEL = "sim-model"
# Each streamed token takes 10 ms: a request for N tokens stays in flight ~N/100 s.
PACED = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "10")
BOUND_SLACK = 8.0  # seconds: generous wait for what the bounds say takes ~0.2-1.1 s


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[dict]]:
    with sim("vllm", MODEL, 8192, *PACED) as one, sim("vllm", MODEL, 8192, *PACED) as two:
        yield [{"url": one, "engine": "vllm", "name": "r1"},
               {"url": two, "engine": "vllm", "name": "r2"}]


@contextlib.contextmanager
def gateway(tmp_path: Path, replicas: list[dict], redis_url: str | None, prefix: str,
            *extra: str) -> Iterator[tuple[str, object]]:
    """One `llm-gateway serve` process; yields (base URL, process)."""
    config = {"models": [{"name": MODEL, "replicas": replicas}],
              "balancer": "least_outstanding_tokens", "health": {"interval": 0.5},
              "redis_url": redis_url, "redis_key_prefix": prefix}
    path = tmp_path / f"gateway-{free_port()}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    with running(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning",
                  *extra], f"http://127.0.0.1:{port}/ready") as proc:
        yield f"http://127.0.0.1:{port}", proc


def scrape(url: str, name: str) -> dict[str, float]:
    """One metric of a gateway's /metrics: {replica label (or ""): value}."""
    return {labels.get("replica", ""): value for n, labels, value in samples(url) if n == name}


def view(url: str) -> dict[str, float]:
    """The fleet-wide outstanding tokens per replica as this gateway's balancer sees them."""
    return scrape(url, "llm_gateway_shared_view_outstanding_tokens")


def wait_for(condition: Callable[[], bool]) -> float:
    """The seconds until ``condition`` holds, polled finely (some tests report them)."""
    return wait_until(condition, BOUND_SLACK, every=0.02)


def shared_totals(client: redis.Redis, prefix: str) -> dict[str, list[int]]:
    """What every instance published, summed per replica, read from Redis directly."""
    totals: dict[str, list[int]] = {}
    for key in client.scan_iter(match=f"{prefix}load:*"):
        for replica, value in client.hgetall(key).items():
            load = parse_load(value)
            assert load is not None, value
            total = totals.setdefault(replica, [0, 0, 0])
            total[0] += load.outstanding_tokens
            total[1] += load.in_flight
            total[2] += load.prefill_tokens
    return totals


class Stream:
    """A long streaming request in a background thread; ``replica`` is known once headers
    arrive. Errors are kept, not raised (a killed gateway cuts its streams)."""

    def __init__(self, url: str, max_tokens: int, prompt: str = "word " * 200) -> None:
        self.replica: str | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, max_tokens, prompt),
                                       daemon=True)
        self.thread.start()
        if not self.started.wait(10):
            raise AssertionError("stream did not start")

    def _run(self, url: str, max_tokens: int, prompt: str) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                    "stream": True}) as response:
                self.replica = response.headers.get("x-gateway-replica")
                self.started.set()
                for _ in response.iter_bytes():
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported through .error
            self.error = exc
        finally:
            self.started.set()

    def join(self) -> None:
        self.thread.join(30)


def complete(url: str, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens})


def assert_all_zero(urls: list[str], client: redis.Redis, prefix: str) -> None:
    """After all traffic: Redis holds no load, and every instance's view is exactly zero."""
    wait_for(lambda: not any(v for t in shared_totals(client, prefix).values() for v in t))
    for url in urls:
        wait_for(lambda: set(view(url).values()) == {0.0})
        assert set(scrape(url, "llm_gateway_shared_view_in_flight_requests").values()) == {0.0}
    assert not list(client.scan_iter(match=f"{prefix}load:*"))


@pytest.fixture()
def shared_redis() -> Iterator[tuple[redis.Redis, str]]:
    prefix = unique_prefix()
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        yield client, prefix
    finally:
        client.close()
        delete_prefix(SHARED_URL, prefix)


def test_load_sent_through_a_is_seen_and_avoided_by_b(tmp_path, replicas, shared_redis) -> None:
    client, prefix = shared_redis
    with gateway(tmp_path, replicas, SHARED_URL, prefix) as (a, _), \
            gateway(tmp_path, replicas, SHARED_URL, prefix) as (b, _):
        long = Stream(a, max_tokens=400)  # ~4 s on one replica, ~450 tokens reserved
        busy = long.replica
        seen = wait_for(lambda: view(b).get(busy, 0) > 0)
        print(f"\nB saw A's load on {busy} {seen * 1000:.0f} ms after A's headers")
        other = "r2" if busy == "r1" else "r1"
        for _ in range(8):  # each ~40 ms, while the long one still runs
            response = complete(b)
            assert response.status_code == 200
            assert response.headers["x-gateway-replica"] == other
        assert long.thread.is_alive(), "the long request ended before B's requests"
        long.join()
        assert long.error is None
        assert_all_zero([a, b], client, prefix)


def test_sigkilled_instance_leaves_no_phantom_load(tmp_path, replicas, shared_redis) -> None:
    client, prefix = shared_redis
    with gateway(tmp_path, replicas, SHARED_URL, prefix) as (a, a_proc), \
            gateway(tmp_path, replicas, SHARED_URL, prefix) as (b, _):
        long = Stream(a, max_tokens=2000, prompt="word " * 1000)  # ~20 s if not killed
        busy = long.replica
        wait_for(lambda: view(b).get(busy, 0) > 1000)
        assert len(client.zrange(f"{prefix}instances", 0, -1)) == 2
        a_proc.send_signal(signal.SIGKILL)
        a_proc.wait(10)
        gone = wait_for(lambda: view(b).get(busy, 0) == 0)
        print(f"\nphantom load gone from B's view {gone * 1000:.0f} ms after SIGKILL "
              f"(bound: peer_ttl 1.0 s + interval 0.1 s)")
        long.join()
        assert long.error is not None  # its gateway died under it
        wait_for(lambda: len(client.zrange(f"{prefix}instances", 0, -1)) == 1)
        # The survivor balances on true load: equal requests split evenly.
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: complete(b, max_tokens=100), range(4)))
        assert [r.status_code for r in replies] == [200] * 4
        placed = sorted(r.headers["x-gateway-replica"] for r in replies)
        assert placed == ["r1", "r1", "r2", "r2"]
        assert_all_zero([b], client, prefix)


def test_redis_killed_and_restarted_mid_run_fails_no_request(tmp_path, replicas) -> None:
    with private_redis(tmp_path) as server:
        client = server.client()
        prefix = "llm-gateway:"
        with gateway(tmp_path, replicas, server.url, prefix) as (a, _), \
                gateway(tmp_path, replicas, server.url, prefix) as (b, _):
            stop = threading.Event()
            outcomes: list[int | str] = []

            def traffic(url: str) -> None:
                while not stop.is_set():
                    try:
                        outcomes.append(complete(url, max_tokens=5).status_code)
                    except httpx.HTTPError as exc:
                        outcomes.append(repr(exc))

            with ThreadPoolExecutor(4) as pool:
                for url in (a, b, a, b):
                    pool.submit(traffic, url)
                try:
                    wait_until(lambda: len(outcomes) >= 4, 10, "traffic through both")
                    up = "llm_gateway_shared_state_up"
                    assert scrape(a, up)[""] == scrape(b, up)[""] == 1
                    server.kill()
                    wait_for(lambda: scrape(a, up)[""] == scrape(b, up)[""] == 0)
                    # Down past the peer TTL: each balances on its own load. A long request
                    # through A now is invisible to B until Redis is back.
                    # 1,200 tokens at 10 ms: still running (its load >= 300) long after
                    # Redis is back, however slowly a loaded machine restarts it.
                    long = Stream(a, max_tokens=1200)
                    time.sleep(1.5)  # the thing tested: down past the peer TTL
                    assert view(b)[long.replica] < 600
                    server.start()  # empty: nothing persisted
                    back = wait_for(lambda: scrape(a, up)[""] == scrape(b, up)[""] == 1)
                    converged = wait_for(lambda: view(b)[long.replica] >= 300)
                    print(f"\nRedis back: both in sync after {back * 1000:.0f} ms, B sees A's "
                          f"load {converged * 1000:.0f} ms later")
                    failures = scrape(b, "llm_gateway_shared_state_sync_failures_total")[""]
                    assert failures >= 1
                    time.sleep(0.3)  # the scenario: traffic goes on a while after Redis is back
                finally:
                    stop.set()
            long.join()
            assert long.error is None
            assert len(outcomes) > 20
            assert [o for o in outcomes if o != 200] == []
            assert_all_zero([a, b], client, prefix)
        client.close()


@contextlib.contextmanager
def serve_workers(tmp_path: Path, replicas: list[dict], workers: int,
                  **settings: object) -> Iterator[tuple[str, Path]]:
    """`serve --workers N` in a process group of its own, so that the workers go too when
    the test ends however it ends; yields (base URL, file with its log)."""
    config = {"models": [{"name": MODEL, "replicas": replicas}], **settings}
    path = tmp_path / f"gateway-{free_port()}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                 "--port", str(port), "--workers", str(workers),
                                 "--log-level", "warning"], cwd=ROOT, stdout=out, stderr=out,
                                start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", 90, proc)
        yield f"http://127.0.0.1:{port}", log
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_serve_workers_share_load_through_redis(tmp_path, replicas, shared_redis) -> None:
    """`serve --workers 2` with redis_url: both worker processes join the shared view and
    leave it when stopped; without redis_url the blind balancing is warned about."""
    client, prefix = shared_redis
    with serve_workers(tmp_path, replicas, 2, redis_url=SHARED_URL,
                       redis_key_prefix=prefix) as (url, log):
        wait_for(lambda: len(client.zrange(f"{prefix}instances", 0, -1)) == 2)
        assert complete(url).status_code == 200
    # Stopped gracefully: both withdrew at once instead of waiting out their TTL.
    assert client.zrange(f"{prefix}instances", 0, -1) == []
    assert "without redis_url" not in log.read_text()
    with serve_workers(tmp_path, replicas, 2) as (url, log):
        assert complete(url).status_code == 200
    assert "2 workers without redis_url: each worker balances on its own view" in log.read_text()
