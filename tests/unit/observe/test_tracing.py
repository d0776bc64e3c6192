"""Tracing's spans from the data path's records, without sockets: an in-memory exporter
stands where the OTLP exporter goes (the wire is tested in tests/integration/test_observe.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind

from gateway.config import ConfigError, TracingConfig
from gateway.upstream.failure import FailureKind
from gateway.dataplane.outcome import Attempt, Outcomes, RequestRecord
from gateway.fleet.replica import Replica
from gateway.observe.tracing import Tracing, from_config
from gateway.protocol.errors import Api
from gateway.protocol.request import GenerationRequest
from gateway.protocol.usage import Usage

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


def tracing(ratio: float = 1.0) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, ratio), exporter


def request(stream: bool = True, shadow: bool = False) -> GenerationRequest:
    return GenerationRequest(api=Api.OPENAI, path="/v1/chat/completions", body={}, raw=b"{}",
                             model="llama", stream=stream, max_tokens=16,
                             messages=[{"role": "user", "content": "a secret prompt"}],
                             shadow=shadow)


def attempt(record: RequestRecord, name: str, at: float, queued: float = 0.0) -> Attempt:
    replica = Replica(name=name, url=f"http://10.0.0.1:80/{name}", engine="vllm",
                      model="llama", pool="stable")
    placement = SimpleNamespace(replica=replica, queued_for=queued)
    one = Attempt(record.request, placement, record.arrival)  # type: ignore[arg-type]
    one.sent_at = at
    record.attempts.append(one)
    return one


def served_with_retry(outcomes: Outcomes, traceparent: bytes | None = None) -> RequestRecord:
    record = RequestRecord("req-1", Api.OPENAI, "/v1/chat/completions", 100.0, traceparent)
    outcomes.request_started(record)
    record.request, record.model, record.key, record.admitted_at = request(), "llama", "team-a", 100.001
    first = attempt(record, "r0", 100.002, queued=0.001)
    header = outcomes.sending(first, record)
    assert header and header[0][0] == b"traceparent"
    first.end(502, FailureKind.HTTP_5XX)
    first.retried = True  # as the retry loop marks it
    first.ended_at = 100.005
    outcomes.ended(first)
    second = attempt(record, "r1", 100.010)
    outcomes.sending(second, record)
    second.answered = True
    second.first_at, second.last_at = 100.050, 100.150
    second.usage = Usage(12, 11, "stop")
    outcomes.first_token(second)
    second.end(200)
    second.ended_at = 100.150
    outcomes.ended(second)
    record.status, record.ended_at = 200, 100.2
    outcomes.request_ended(record)
    return record


def test_a_retried_request_is_one_trace_with_sibling_attempts_and_the_engine_header() -> None:
    tracer, exporter = tracing()
    record = served_with_retry(Outcomes([tracer]))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "admission", "queue", "chat llama"}
    root = spans["POST /v1/chat/completions"]
    assert root.parent is None and root.kind is SpanKind.SERVER
    attempts = [s for s in exporter.get_finished_spans() if s.name == "chat llama"]
    assert len(attempts) == 2
    assert all(s.parent.span_id == root.context.span_id for s in attempts)  # siblings
    assert {s.context.trace_id for s in exporter.get_finished_spans()} == {root.context.trace_id}
    failed, served = sorted(attempts, key=lambda s: s.start_time)
    assert failed.attributes["error.type"] == "http_5xx" and not failed.status.is_ok
    assert served.attributes["gen_ai.usage.input_tokens"] == 12
    assert served.attributes["gen_ai.usage.output_tokens"] == 11
    assert served.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert served.attributes["llm_gateway.replica"] == "r1"
    assert (served.attributes["server.address"], served.attributes["server.port"]) == (
        "10.0.0.1", 80)
    assert root.status.is_unset  # served: the failed attempt is no failure of the request
    assert [e.name for e in served.events] == ["first_token"]
    # Times: the records' perf_counter seconds as nanoseconds apart.
    assert served.end_time - served.start_time == pytest.approx(140_000_000, abs=1000)
    assert root.end_time - root.start_time == pytest.approx(200_000_000, abs=1000)
    assert root.attributes["llm_gateway.retries"] == 1
    assert root.attributes["gen_ai.request.model"] == "llama"
    assert root.attributes["llm_gateway.key"] == "team-a"
    assert record.trace_id == format(root.context.trace_id, "032x")
    for span in exporter.get_finished_spans():  # never the prompt
        assert "a secret prompt" not in repr(dict(span.attributes))


def test_the_attempts_traceparent_names_the_attempt_span() -> None:
    tracer, exporter = tracing()
    outcomes = Outcomes([tracer])
    record = RequestRecord("r", Api.OPENAI, "/v1/completions", 1.0)
    outcomes.request_started(record)
    record.request = request(stream=False)
    one = attempt(record, "r0", 1.1)
    (name, value), = outcomes.sending(one, record)
    one.end(200)
    outcomes.ended(one)
    record.ended_at = 1.2
    outcomes.request_ended(record)
    span = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT)
    context = span.context
    assert value.decode() == (f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                              f"{int(context.trace_flags):02x}")
    assert context.trace_flags.sampled


def test_a_clients_traceparent_is_continued() -> None:
    tracer, exporter = tracing(ratio=0.0)  # the client's sampled flag decides
    served_with_retry(Outcomes([tracer]), f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01".encode())
    spans = exporter.get_finished_spans()
    assert spans and {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}
    root = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert format(root.parent.span_id, "016x") == CLIENT_PARENT


@pytest.mark.parametrize("traceparent", [b"garbage", b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01",
                                          b"\xff" * 55])
def test_a_bad_traceparent_starts_a_new_trace(traceparent: bytes) -> None:
    tracer, exporter = tracing()
    served_with_retry(Outcomes([tracer]), traceparent)
    root = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert root.parent is None


def test_unsampled_requests_record_nothing_but_still_propagate_context() -> None:
    tracer, exporter = tracing(ratio=0.0)
    outcomes = Outcomes([tracer])
    record = RequestRecord("r", Api.OPENAI, "/v1/completions", 1.0)
    outcomes.request_started(record)
    record.request = request()
    one = attempt(record, "r0", 1.1)
    (_, value), = outcomes.sending(one, record)
    assert not int(value[-2:], 16) & 1  # not sampled: the engine records nothing either
    one.end(200)
    outcomes.ended(one)
    record.ended_at = 1.2
    outcomes.request_ended(record)
    assert exporter.get_finished_spans() == ()


def test_a_shadow_attempt_is_its_own_trace_linked_to_its_primary() -> None:
    tracer, exporter = tracing()
    outcomes = Outcomes([tracer])
    primary = RequestRecord("p", Api.OPENAI, "/v1/chat/completions", 1.0)
    outcomes.request_started(primary)
    primary.ended_at = 1.05
    outcomes.request_ended(primary)  # a short primary ends before its copy is sent
    copy = RequestRecord("p-shadow", Api.OPENAI, "/v1/chat/completions", 1.1, primary=primary,
                         request=request(shadow=True))
    one = attempt(copy, "canary-0", 1.2)
    outcomes.sending(one, copy)
    one.end(200)
    outcomes.ended(one)
    shadow = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT)
    assert shadow.parent is None and shadow.attributes["llm_gateway.role"] == "shadow"
    assert shadow.links[0].context.span_id == primary.trace.get_span_context().span_id
    assert shadow.context.trace_id != primary.trace.get_span_context().trace_id


def test_config_and_the_sdk_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    tracer = from_config(TracingConfig(enabled=True))
    try:
        assert tracer.provider.resource.attributes["service.name"] == "from-env"
        assert tracer.sampling == 0.25
    finally:
        tracer.provider.shutdown()
    tracer = from_config(TracingConfig(enabled=True, sampling=0.5, service_name="gw"))
    try:  # the config file wins
        assert tracer.provider.resource.attributes["service.name"] == "gw"
        assert tracer.sampling == 0.5
    finally:
        tracer.provider.shutdown()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "lots")
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        from_config(TracingConfig(enabled=True))


def test_the_sampling_ratio_records_about_that_share_and_the_rest_costs_no_sdk_span() -> None:
    tracer, exporter = tracing(ratio=0.2)
    outcomes = Outcomes([tracer])
    recorded = 0
    for i in range(500):
        record = RequestRecord(f"r{i}", Api.OPENAI, "/v1/completions", 1.0)
        outcomes.request_started(record)
        record.request = request()
        one = attempt(record, "r0", 1.1)
        (_, value), = outcomes.sending(one, record)
        assert value.decode().split("-")[1] == record.trace_id  # one trace id, logged too
        one.end(200)
        outcomes.ended(one)
        recorded += record.trace.is_recording()  # (before its end)
        record.ended_at = 1.2
        outcomes.request_ended(record)
    assert 60 < recorded < 140
    assert len([s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]) == recorded


def test_a_clients_unsampled_traceparent_is_kept_unsampled_in_its_trace() -> None:
    tracer, exporter = tracing(ratio=1.0)
    outcomes = Outcomes([tracer])
    record = RequestRecord("r", Api.OPENAI, "/v1/completions", 1.0,
                           f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-00".encode())
    outcomes.request_started(record)
    record.request = request()
    one = attempt(record, "r0", 1.1)
    (_, value), = outcomes.sending(one, record)
    assert value.startswith(f"00-{CLIENT_TRACE}-".encode()) and value.endswith(b"-00")
    assert record.trace_id == CLIENT_TRACE and not record.trace.is_recording()
