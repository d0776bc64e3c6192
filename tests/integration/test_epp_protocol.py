"""The endpoint picker's side of the protocol, spoken to it directly over gRPC as a proxy
would (GIE's docs/proposals/004-endpoint-picker-protocol, in full-duplex mode as kgateway,
Istio and Envoy AI Gateway configure it): the pick as header and metadata with its
fallbacks, the body sent back, the proxy's subset hint obeyed (503 when nothing in it can
serve), the served endpoint's report moving the reservation, the gRPC health services, and
bad input (a message that is not one, messages out of order, a stream cut midway) answered
without leaking a reservation or taking the picker down."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_support import Picker, picker
from gateway.epp import messages as ext_proc
from gateway.epp import wire
from scrape import by_label
from support import sim, wait_until

MODEL = "sim-model"
PACED = ("--profile", "paced", "--ttft-ms", "20", "--itl-ms", "20")


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    with sim("vllm", MODEL, 2048, *PACED) as a, sim("vllm", MODEL, 2048, *PACED) as b:
        yield a, b


@pytest.fixture(scope="module")
def epp(replicas: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    config = {"models": [{"name": MODEL, "replicas": [{"url": u, "engine": "vllm"}
                                                     for u in replicas]}],
              "health": {"interval": 30}}
    with picker(tmp_path_factory.mktemp("epp"), config) as p:
        yield p


@pytest.fixture(scope="module")
def channel(epp: Picker) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(epp.grpc) as ch:
        yield ch


def endpoint(url: str) -> str:
    return url.split("//", 1)[1]


def headers_message(path: str = "/v1/completions", subset: list[str] | None = None,
                    end: bool = False) -> ext_proc.ProcessingRequest:
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(end_of_stream=end, headers=ext_proc.HeaderMap(headers=[
            ext_proc.HeaderValue(key=k, raw_value=v.encode())
            for k, v in [(":method", "POST" if not end else "GET"), (":path", path),
                         ("content-type", "application/json")]])),
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=ext_proc.FULL_DUPLEX, response_body_mode=ext_proc.FULL_DUPLEX))
    if subset is not None:
        message.metadata_context.filter_metadata[wire.SUBSET_NAMESPACE].fields[
            wire.SUBSET].list_value.values.add().string_value = ",".join(subset)
    return message


def body_message(body: dict | bytes) -> ext_proc.ProcessingRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=raw, end_of_stream=True))


def response_headers_message(served: str | None, status: int = 200) -> ext_proc.ProcessingRequest:
    message = ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(
        headers=ext_proc.HeaderMap(headers=[ext_proc.HeaderValue(key=":status",
                                                         raw_value=str(status).encode())])))
    if served is not None:
        message.metadata_context.filter_metadata[wire.NAMESPACE].fields[
            wire.SERVED].string_value = served
    return message


REQUEST = {"model": MODEL, "prompt": "pick me a replica", "max_tokens": 40}


class Conversation:
    """One ext_proc stream held open: send a message, read the answers it gets."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.outbox: list[Any] = []
        self.closed = False
        self._wake = threading.Condition()
        process = channel.stream_stream(ext_proc.METHOD,
                                        request_serializer=ext_proc.ProcessingRequest.SerializeToString,
                                        response_deserializer=ext_proc.ProcessingResponse.FromString)
        self.call = process(self._messages(), timeout=30)

    def _messages(self) -> Iterator[ext_proc.ProcessingRequest]:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self.outbox or self.closed)
                if self.outbox:
                    yield self.outbox.pop(0)
                    continue
                return

    def send(self, message: ext_proc.ProcessingRequest, answers: int) -> list[Any]:
        with self._wake:
            self.outbox.append(message)
            self._wake.notify()
        return [next(self.call) for _ in range(answers)]

    def end(self) -> None:
        with self._wake:
            self.closed = True
            self._wake.notify()
        list(self.call)  # the picker ends its side too


def destination(answer: ext_proc.ProcessingResponse) -> tuple[str, str]:
    """The pick as (header, metadata): the protocol wants both, equal."""
    header = next(h.header.raw_value.decode() for h in
                  answer.request_headers.response.header_mutation.set_headers
                  if h.header.key == wire.DESTINATION)
    metadata = answer.dynamic_metadata.fields[wire.NAMESPACE].struct_value.fields[
        wire.DESTINATION].string_value
    return header, metadata


def in_flight(epp: Picker) -> dict[str, float]:
    return by_label(epp.url, "llm_gateway_replica_in_flight_requests", "replica")


def idle(epp: Picker) -> bool:
    return sum(in_flight(epp).values()) == 0


def test_the_pick_comes_as_header_and_metadata_with_fallbacks_and_the_body_goes_back(
        channel: grpc.Channel, epp: Picker, replicas: tuple[str, str]) -> None:
    talk = Conversation(channel)
    assert talk.send(headers_message(), 0) == []  # full-duplex: the pick waits for the body
    pick, body = talk.send(body_message(REQUEST), 2)
    header, metadata = destination(pick)
    assert header == metadata
    picked = header.split(",")
    assert sorted(picked) == sorted(endpoint(u) for u in replicas)  # pick, then a fallback
    assert pick.request_headers.response.clear_route_cache
    assert "content-length" in pick.request_headers.response.header_mutation.remove_headers
    sent = body.request_body.response.body_mutation.streamed_response
    assert orjson.loads(sent.body) == REQUEST and sent.end_of_stream
    assert in_flight(epp)[picked[0]] == 1
    talk.send(response_headers_message(picked[0]), 1)
    talk.end()
    wait_until(lambda: idle(epp), 10, "the reservation to end with the stream")


def test_the_subset_hint_is_obeyed_and_an_empty_one_is_a_503(
        channel: grpc.Channel, epp: Picker, replicas: tuple[str, str]) -> None:
    only = endpoint(replicas[1])
    for _ in range(3):  # whatever the load, never outside the subset
        talk = Conversation(channel)
        talk.send(headers_message(subset=[only]), 0)
        pick, _ = talk.send(body_message(REQUEST), 2)
        assert destination(pick)[0] == only  # no fallback outside it either
        talk.end()
    talk = Conversation(channel)
    talk.send(headers_message(subset=["10.9.9.9:8000"]), 0)
    (refusal,) = talk.send(body_message(REQUEST), 1)
    assert refusal.immediate_response.status.code == 503
    assert orjson.loads(refusal.immediate_response.body)["error"]["type"] == "server_error"
    talk.end()
    wait_until(lambda: idle(epp), 10, "nothing reserved")


def test_the_served_endpoint_report_moves_the_reservation(
        channel: grpc.Channel, epp: Picker, replicas: tuple[str, str]) -> None:
    talk = Conversation(channel)
    talk.send(headers_message(), 0)
    pick, _ = talk.send(body_message({**REQUEST, "stream": True}), 2)
    first, fallback = destination(pick)[0].split(",")
    assert in_flight(epp) == {first: 1.0, fallback: 0.0}
    talk.send(response_headers_message(fallback), 1)  # the proxy retried on the fallback
    assert in_flight(epp) == {first: 0.0, fallback: 1.0}
    talk.end()
    wait_until(lambda: idle(epp), 10, "the moved reservation to end with the stream")


def test_a_request_that_is_not_for_generation_goes_to_any_replica_unreserved(
        channel: grpc.Channel, epp: Picker, replicas: tuple[str, str]) -> None:
    talk = Conversation(channel)
    (pick,) = talk.send(headers_message("/v1/models", end=True), 1)
    assert destination(pick)[0].split(",")[0] in {endpoint(u) for u in replicas}
    assert idle(epp)
    talk.end()


@pytest.mark.parametrize("body, status", [(b"{not json", 400), ({"model": "nope", "prompt": "hi"}, 404),
                                          ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400)])
def test_bad_bodies_get_the_gateways_answer_and_reserve_nothing(
        channel: grpc.Channel, epp: Picker, body: Any, status: int) -> None:
    talk = Conversation(channel)
    talk.send(headers_message(), 0)
    (refusal,) = talk.send(body_message(body), 1)
    assert refusal.immediate_response.status.code == status
    error = orjson.loads(refusal.immediate_response.body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    talk.end()
    assert idle(epp)


def test_a_stream_cut_after_the_pick_releases_its_reservation(channel: grpc.Channel,
                                                               epp: Picker) -> None:
    talk = Conversation(channel)
    talk.send(headers_message(), 0)
    talk.send(body_message(REQUEST), 2)
    assert sum(in_flight(epp).values()) == 1
    talk.call.cancel()  # the proxy went away mid-request
    wait_until(lambda: idle(epp), 10, "the reservation released on the cut")


def test_messages_out_of_order_or_not_messages_do_not_take_it_down(channel: grpc.Channel,
                                                                   epp: Picker) -> None:
    # Response headers before any request: answered, nothing reserved.
    talk = Conversation(channel)
    (answer,) = talk.send(response_headers_message(None), 1)
    assert answer.WhichOneof("response") == "response_headers"
    talk.end()
    # Bytes that are no ProcessingRequest: the call fails, the picker goes on.
    garbage = channel.stream_stream(ext_proc.METHOD,
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as failure:
        list(garbage(iter([b"\xff\xff\xff\xff not protobuf"]), timeout=10))
    assert failure.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    talk = Conversation(channel)
    talk.send(headers_message(), 0)
    pick, _ = talk.send(body_message(REQUEST), 2)
    assert destination(pick)[0]
    talk.end()
    wait_until(lambda: idle(epp), 10, "nothing left reserved")


def test_the_grpc_health_services(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as unknown:
        health.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_two_pickers_cannot_bind_one_port(epp: Picker, tmp_path: Path) -> None:
    """gRPC reuses ports by default: a second picker on the same port would share its
    streams silently. It must fail to start instead."""
    import subprocess
    import sys
    import yaml

    config = tmp_path / "same.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": MODEL, "replicas": [
        {"url": "http://127.0.0.1:9", "engine": "vllm"}]}]}))
    port = epp.grpc.rsplit(":", 1)[1]
    second = subprocess.run([sys.executable, "-m", "gateway", "epp", "--config", str(config),
                             "--grpc-port", port, "--port", "0", "--log-level", "warning"],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode != 0


def test_tls_on_the_grpc_port_and_plaintext_health_for_probes(
        replicas: tuple[str, str], tmp_path: Path) -> None:
    """Envoy AI Gateway dials its picker with TLS; kubelet's gRPC probes are plaintext."""
    import subprocess

    from support import free_port

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    health_port = free_port()
    config = {"models": [{"name": MODEL, "replicas": [{"url": u, "engine": "vllm"}
                                                     for u in replicas]}]}
    with picker(tmp_path, config, "--tls-cert", str(cert), "--tls-key", str(key),
                "--health-port", str(health_port)) as p:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(p.grpc, credentials) as secure:
            talk = Conversation(secure)
            talk.send(headers_message(), 0)
            pick, _ = talk.send(body_message(REQUEST), 2)
            assert destination(pick)[0]
            talk.end()
        with grpc.insecure_channel(p.grpc) as plain:  # no TLS: refused
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as probes:
            reply = health_pb2_grpc.HealthStub(probes).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as no_ext_proc:  # health alone on that port
                Conversation(probes).send(headers_message("/v1/models", end=True), 1)
            assert no_ext_proc.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_only_replicas_that_serve_a_request_alone_are_picked(tmp_path: Path) -> None:
    """A decode replica needs its prefill elsewhere first (the HTTP gateway's work): never
    picked, nor named as a fallback."""
    with sim("vllm", MODEL, 2048, "--role", "decode") as decode, sim("vllm", MODEL, 2048) as both:
        config = {"models": [{"name": MODEL, "replicas": [
            {"url": decode, "engine": "vllm", "role": "decode"},
            {"url": both, "engine": "vllm"}]}]}
        with picker(tmp_path, config) as p, grpc.insecure_channel(p.grpc) as channel:
            for _ in range(3):
                talk = Conversation(channel)
                talk.send(headers_message(), 0)
                pick, _ = talk.send(body_message(REQUEST), 2)
                assert destination(pick)[0] == endpoint(both)
                talk.end()


def test_what_the_proxys_retries_showed_ejects_the_replicas_that_failed(tmp_path: Path) -> None:
    """Served on the pick's second fallback: the proxy tried the pick and the first fallback
    and both failed before answering (it retries only then). The picker counts that against
    them as the HTTP gateway counts its own attempts, so a replica that died stops being
    picked before its health probe notices. An error answer counts against nobody (a 4xx is
    the request's fault; a 503 may be the proxy's own, from its limits)."""
    with sim("vllm", MODEL, 2048) as a, sim("vllm", MODEL, 2048) as b, \
            sim("vllm", MODEL, 2048) as c:
        config = {"models": [{"name": MODEL, "replicas": [
            {"url": u, "engine": "vllm", "name": n} for n, u in zip("abc", (a, b, c))]}],
            "health": {"interval": 30}, "admin_token": "admin",
            "outlier": {"consecutive_failures": 1, "base_ejection": 60,
                        "max_ejected_percent": 100}}
        with picker(tmp_path, config) as p, grpc.insecure_channel(p.grpc) as channel:
            def states() -> dict[str, str]:
                answer = httpx.get(p.url + "/admin/replicas", timeout=5,
                                   headers={"authorization": "Bearer admin"})
                return {r["url"]: r["state"] for r in answer.json()["replicas"]}

            def served(status: int, last: bool = True) -> list[str]:
                talk = Conversation(channel)
                talk.send(headers_message(), 0)
                pick, _ = talk.send(body_message(REQUEST), 2)
                endpoints = destination(pick)[0].split(",")
                talk.send(response_headers_message(endpoints[-1 if last else 0], status), 1)
                talk.end()
                return endpoints

            tried = served(200)  # the pick and its two fallbacks: the last one answered
            assert len(tried) == 3
            by_endpoint = {endpoint(u): u for u in (a, b, c)}
            failed, answered = [by_endpoint[e] for e in tried[:2]], by_endpoint[tried[2]]
            assert states() == {failed[0]: "ejected", failed[1]: "ejected",
                                answered: "healthy"}
            for status in (404, 503):
                assert served(status) == [endpoint(answered)]  # alone now: no fallback
                assert states()[answered] == "healthy"
