"""DNS discovery against a real DNS server on loopback (dnslib) whose answers the test
changes, with simulated replicas on 127.0.0.2-4 (one port, as pods of a headless Service)
and traffic flowing through a real gateway the whole time: addresses join after their
health check, vanished ones drain (a stream in flight finishes, no new request goes there)
and are removed, and no request is lost (retries off, so none is papered over)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from gateway.config import ConfigError, load_settings
from gateway.fleet.dns_config import DnsConfig
from gateway.fleet.dns_discovery import DnsResolver
from support import gateway_server, sim, wait_until

NAME = "engines.llm.test"
MODEL = "sim-model"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
PACED = ("--profile", "paced", "--ttft-ms", "20", "--itl-ms", "10")
ADMIN = {"authorization": "Bearer admin-token"}


class Answers(BaseResolver):
    """Authoritative answers the test sets: name -> addresses (absent: NXDOMAIN)."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def set(self, name: str, addresses: list[str] | None) -> None:
        with self.lock:
            if addresses is None:
                self.records.pop(name, None)
            else:
                self.records[name] = list(addresses)

    def resolve(self, request, handler):  # noqa: ANN001, ANN201 (dnslib's interface)
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        with self.lock:
            addresses = self.records.get(qname)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        for address in addresses or []:
            if request.q.qtype == QTYPE.A and ":" not in address:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
            elif request.q.qtype == QTYPE.AAAA and ":" in address:
                reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(address), ttl=0))
        return reply


@contextlib.contextmanager
def dns_server() -> Iterator[tuple[str, Answers]]:
    """A DNS server on a free loopback UDP port; yields ("127.0.0.1:port", its answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    answers = Answers()
    server = DNSServer(answers, address="127.0.0.1", port=port,
                       logger=DNSLogger(logf=lambda _: None))
    server.start_thread()
    try:
        yield f"127.0.0.1:{port}", answers
    finally:
        server.stop()
        server.server.server_close()


def port_free_on_every_host() -> int:
    """One port every simulated pod can listen on."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind((HOSTS[0], 0))
            port = s.getsockname()[1]
        try:
            for host in HOSTS[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback host")


def fleet(gateway: str) -> dict[str, dict]:
    reply = httpx.get(gateway + "/admin/replicas", headers=ADMIN, timeout=5)
    reply.raise_for_status()
    return {r["name"]: r for r in reply.json()["replicas"]}


def stream(gateway: str, max_tokens: int) -> tuple[str, int]:
    """One streamed completion, read to its end; (replica that served it, tokens received).
    Anything but a whole, error-free stream fails the test."""
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200, reply.read()
        replica, usage, done = reply.headers["x-gateway-replica"], None, False
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
    assert done and usage, (replica, usage)
    return replica, usage["completion_tokens"]


class Traffic:
    """Streams through the gateway from a few threads until stopped (bounded in count and
    time); keeps (start, end, replica, tokens) of each, and every failure."""

    def __init__(self, gateway: str, threads: int = 4, max_requests: int = 3000,
                 max_seconds: float = 90.0) -> None:
        self.gateway = gateway
        self.served: list[tuple[float, float, str, int]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._budget = iter(range(max_requests))
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + max_seconds
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            with self._lock:
                if next(self._budget, None) is None:
                    return
            started = time.monotonic()
            try:
                replica, tokens = stream(self.gateway, 8)
                self.served.append((started, time.monotonic(), replica, tokens))
            except Exception as exc:  # noqa: BLE001 (every failure is reported)
                self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=40)


def test_replicas_join_and_drain_as_the_answers_change_and_no_request_is_lost(
        tmp_path: Path) -> None:
    port = port_free_on_every_host()
    name = {host: f"{host}:{port}" for host in HOSTS}
    with dns_server() as (nameserver, answers), contextlib.ExitStack() as pods:
        for host in HOSTS:
            pods.enter_context(sim("vllm", MODEL, 4096, *PACED, host=host, port=port))
        answers.set(NAME, [HOSTS[0]])
        config = {"models": [{"name": MODEL,
                              "replicas": [{"dns": NAME, "port": port, "engine": "vllm"}]}],
                  "dns": {"nameservers": [nameserver], "interval": 0.2, "timeout": 1.0},
                  "health": {"interval": 0.5, "timeout": 1.0}, "retries": {"max_attempts": 1},
                  "admin_token": "admin-token", "drain_timeout": 30}
        with gateway_server(tmp_path, config) as (gateway, _), \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert {n: r["state"] for n, r in fleet(gateway).items()} == {name[HOSTS[0]]:
                                                                          "healthy"}
            # A long stream on the only replica; then the answer moves to the two others.
            long_stream = pool.submit(stream, gateway, 250)  # ~2.5 s of tokens
            wait_until(lambda: fleet(gateway)[name[HOSTS[0]]]["in_flight"] == 1, 15,
                       "the long stream in flight")
            traffic = Traffic(gateway)
            try:
                answers.set(NAME, list(HOSTS[1:]))
                wait_until(lambda: {n: r["state"] for n, r in fleet(gateway).items()} == {
                    name[HOSTS[0]]: "draining", name[HOSTS[1]]: "healthy",
                    name[HOSTS[2]]: "healthy"}, 15,
                    "new addresses joined, the vanished one draining")
                drain_seen = time.monotonic()
                joined = fleet(gateway)
                # They joined after discovery (the window) and a health check.
                assert joined[name[HOSTS[1]]]["max_model_len"] == 4096
                # The draining replica's stream runs to its end; then it is removed.
                assert not long_stream.done()
                assert long_stream.result(timeout=30) == (name[HOSTS[0]], 250)
                wait_until(lambda: name[HOSTS[0]] not in fleet(gateway), 15,
                           "the drained replica removed")
                removed_first = time.monotonic()
                # One more leaves; then the first address comes back.
                answers.set(NAME, [HOSTS[2]])
                wait_until(lambda: set(fleet(gateway)) == {name[HOSTS[2]]}, 15,
                           "the second address removed")
                second_gone = time.monotonic()
                first_back = time.monotonic()
                answers.set(NAME, [HOSTS[0], HOSTS[2]])
                wait_until(lambda: {n: r["state"] for n, r in fleet(gateway).items()} == {
                    name[HOSTS[0]]: "healthy", name[HOSTS[2]]: "healthy"}, 15,
                    "the first address back")
                rejoined = time.monotonic()
                wait_until(lambda: any(r == name[HOSTS[0]] and start > rejoined
                                       for start, _, r, _ in list(traffic.served)), 15,
                           "traffic on the first address again")
            finally:
                traffic.stop()
            assert not traffic.failures, traffic.failures[:5]
            served = traffic.served
            # enough traffic to span every phase (about 50 on a quiet machine, fewer under load)
            assert len(served) > 20 and all(tokens == 8 for *_, tokens in served)

            def served_by(since: float, until: float) -> set[str]:
                """Replicas of the requests that began and ended between the two times (a
                request is placed somewhere in between: a client may take a while to send)."""
                return {r for start, end, r, _ in served if since < start and end < until}
            # Nothing new went to a draining or removed replica; the joined ones took traffic.
            assert name[HOSTS[0]] not in served_by(drain_seen, first_back)
            assert name[HOSTS[1]] not in served_by(second_gone, float("inf"))
            assert served_by(drain_seen, removed_first) == {name[HOSTS[1]], name[HOSTS[2]]}
            assert name[HOSTS[0]] in served_by(rejoined, float("inf"))


async def test_resolver_answers_and_failures(tmp_path: Path) -> None:
    """NXDOMAIN is no replicas; no answer at all keeps what there is (None); AAAA when the
    name has no A record."""
    with dns_server() as (nameserver, answers):
        resolver = DnsResolver(DnsConfig(nameservers=[nameserver], timeout=1.0))
        answers.set(NAME, ["127.0.0.2", "127.0.0.3"])
        assert await resolver.resolve(NAME) == {"127.0.0.2", "127.0.0.3"}
        answers.set(NAME, ["::1"])
        assert await resolver.resolve(NAME) == {"::1"}
        answers.set(NAME, [])
        assert await resolver.resolve(NAME) == frozenset()
        answers.set(NAME, None)
        assert await resolver.resolve(NAME) == frozenset()
    silent = DnsResolver(DnsConfig(nameservers=[nameserver], timeout=0.3))  # server gone
    assert await silent.resolve(NAME) is None


def test_dns_entries_are_checked_when_the_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    good = {"models": [{"name": "m", "replicas": [{"dns": NAME, "port": 8000}]}],
            "dns": {"nameservers": ["127.0.0.1:5353", "10.0.0.10", "[::1]:53"]}}
    path.write_text(json.dumps(good))
    settings = load_settings(path)
    assert settings.models[0].pools[0].replicas[0].dns == NAME
    for replica, error in [({"dns": NAME}, "`dns` and `port` go together"),
                           ({"dns": NAME, "port": 1, "url": "http://x"}, "give one of"),
                           ({"dns": NAME, "port": 1, "gpus": 2}, "no `gpus`")]:
        path.write_text(json.dumps({"models": [{"name": "m", "replicas": [replica]}]}))
        with pytest.raises(ConfigError, match=error):
            load_settings(path)
    path.write_text(json.dumps({**good, "dns": {"nameservers": ["dns.example:53"]}}))
    with pytest.raises(ConfigError, match="dns.nameservers|nameserver 'dns.example:53'"):
        load_settings(path)


def test_a_name_with_no_address_holds_requests_until_a_pod_answers(tmp_path: Path) -> None:
    """Scale from zero on a headless Service: no ready pod, so the name has no address; a
    request waits at the gateway (gateway.autoscale.hold) and is served by the first pod
    that appears."""
    port = port_free_on_every_host()
    with dns_server() as (nameserver, answers), \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        answers.set(NAME, [])  # the name exists; no pod is ready
        config = {"models": [{"name": MODEL,
                              "replicas": [{"dns": NAME, "port": port, "engine": "vllm"}]}],
                  "dns": {"nameservers": [nameserver], "interval": 0.2, "timeout": 1.0},
                  "health": {"interval": 0.5, "timeout": 1.0}, "admin_token": "admin-token",
                  "autoscale": {"scale_from_zero": {"timeout": 30}}}
        with gateway_server(tmp_path, config) as (gateway, _):
            assert fleet(gateway) == {}
            held = pool.submit(stream, gateway, 5)
            time.sleep(1.5)
            assert not held.done()
            with sim("vllm", MODEL, 4096, *PACED, host=HOSTS[1], port=port):
                answers.set(NAME, [HOSTS[1]])
                assert held.result(timeout=30) == (f"{HOSTS[1]}:{port}", 5)
