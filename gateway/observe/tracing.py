"""OpenTelemetry traces of requests, built from the data path's records.

A listener (``gateway.dataplane.outcome``): the request's span starts when the edge has read
its headers (continuing the client's W3C ``traceparent``, or starting a trace) and ends with
the answer; each attempt's span starts as it is sent, under the request's span (retries are
siblings), and its context goes to the engine as ``traceparent``, so an engine that traces
(vLLM's ``--otlp-traces-endpoint``) puts its own spans under it. Admission (body, window
check, key limits) and the queue wait are spans of their own, drawn from the record's times.
A canary shadow copy's attempt starts a trace of its own, linked to its primary's request.

Attribute names follow the OpenTelemetry GenAI and HTTP semantic conventions where they name
the fact (``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``http.route`` ...);
the rest are ``llm_gateway.*``. Never a prompt, an output text or a key's secret.

Times are ``perf_counter`` in the records; spans get wall-clock nanoseconds through one
offset taken at start.

Sampling is decided here, before the SDK is called: a request not sampled (the share
``1 - sampling`` of those that start a trace here, and those whose client's ``traceparent``
says not sampled) gets a non-recording span made of two random ids, no more, and so do its
attempts, whose ``traceparent`` still goes to the engine (flags 00: the engine records
nothing either). The SDK, which costs tens of microseconds per span before any export, sees
only the requests that are recorded.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (INVALID_SPAN_ID, Link, NonRecordingSpan, SpanContext,
                                 SpanKind, Status, StatusCode, TraceFlags)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import ConfigError, TracingConfig
from gateway.dataplane.outcome import Attempt, Listener, RequestRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

_PROPAGATOR = TraceContextTextMapPropagator()
_EMPTY = Context()
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)


def _unsampled(trace_id: int) -> NonRecordingSpan:
    """A span that records nothing, in trace ``trace_id``, with a span id of its own."""
    span_id = random.getrandbits(64)
    while span_id == INVALID_SPAN_ID:
        span_id = random.getrandbits(64)
    return NonRecordingSpan(SpanContext(trace_id, span_id, False, _UNSAMPLED))


def _operation(record: RequestRecord) -> str:
    """GenAI ``gen_ai.operation.name`` of the request."""
    request = record.request
    if request is not None and request.is_chat:
        return "chat"
    return "text_completion"


class Tracing(Listener):
    """Spans of requests and attempts, handed to ``provider``'s processors as they end."""

    def __init__(self, provider: "TracerProvider", sampling: float = 1.0) -> None:
        """``provider`` records what it is given (its sampler: parent-based, always on for
        roots); ``sampling`` is the share of the traces started here that are recorded."""
        self.provider = provider
        self.sampling = sampling
        self.tracer = provider.get_tracer("llm-gateway")
        # perf_counter seconds -> epoch nanoseconds
        self.offset = time.time_ns() - int(time.perf_counter() * 1e9)

        self._addresses: dict[str, tuple[str, int]] = {}

    def ns(self, perf: float) -> int:
        return int(perf * 1e9) + self.offset

    def _address(self, url: str) -> tuple[str, int]:
        """A replica's host and port (``server.address``, ``server.port``), parsed once."""
        address = self._addresses.get(url)
        if address is None:
            parts = urlsplit(url)
            address = self._addresses[url] = (
                parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        return address

    # The client request.

    def request_started(self, record: RequestRecord) -> None:
        parent = _EMPTY
        if record.traceparent is not None:
            carrier = {"traceparent": record.traceparent.decode("latin-1")}
            if record.tracestate is not None:
                carrier["tracestate"] = record.tracestate.decode("latin-1")
            parent = _PROPAGATOR.extract(carrier, context=_EMPTY)
            remote = trace.get_current_span(parent).get_span_context()
            if remote.is_valid and not remote.trace_flags.sampled:  # the client's "no"
                self._unrecorded(record, remote.trace_id)
                return
        elif self.sampling < 1.0 and random.random() >= self.sampling:
            self._unrecorded(record, random.getrandbits(128) or 1)
            return
        span = self.tracer.start_span(
            f"POST {record.route}", context=parent, kind=SpanKind.SERVER,
            start_time=self.ns(record.arrival),
            attributes={"http.request.method": "POST", "http.route": record.route,
                        "llm_gateway.request_id": record.request_id,
                        "llm_gateway.api": record.api.value})
        record.trace = span
        context = span.get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")

    @staticmethod
    def _unrecorded(record: RequestRecord, trace_id: int) -> None:
        record.trace = _unsampled(trace_id)
        record.trace_id = format(trace_id, "032x")

    def request_ended(self, record: RequestRecord) -> None:
        span = record.trace  # kept on the record: a shadow copy still sending links to it
        if span is None:
            return
        if not span.is_recording():  # not sampled: nothing more to build
            span.end(end_time=self.ns(record.ended_at))
            return
        if record.admitted_at:
            self.tracer.start_span(
                "admission", context=trace.set_span_in_context(span, _EMPTY),
                start_time=self.ns(record.arrival)).end(end_time=self.ns(record.admitted_at))
        # Each attribute costs the SDK microseconds: what is always so (a zero, a false) or
        # said by another attribute is left out.
        request = record.request
        attributes: dict[str, Any] = {
            "http.response.status_code": record.status,
            "llm_gateway.retries": record.retries,
        }
        queued = record.queued_for
        if queued:
            attributes["llm_gateway.queue_wait_s"] = queued
        if record.client_left:
            attributes["llm_gateway.client_left"] = True
        if request is not None:
            attributes.update(_request_attributes(record))
            attributes["llm_gateway.stream"] = request.stream
            if request.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = request.max_tokens
            if request.choices != 1:
                attributes["gen_ai.request.choice.count"] = request.choices
        if record.model is not None and record.model != attributes.get("gen_ai.request.model"):
            attributes["llm_gateway.model"] = record.model  # the client's name was an alias
        if record.key is not None:
            attributes["llm_gateway.key"] = record.key
        last = record.last
        if last is not None:
            attributes.update(_usage_attributes(last))
            first_at = record.first_token_at
            if first_at is not None:
                attributes["llm_gateway.ttft_s"] = first_at - record.arrival
        error = record.error or (last.error.label if last is not None and last.error else None)
        if error is not None:
            attributes["error.type"] = error
        span.set_attributes(attributes)
        # As HTTP servers mark theirs: a 5xx, or a stream that broke after its 200; a 4xx
        # is the client's (error.type still says which).
        broke = last is not None and last.error is not None and record.status < 400
        if record.status >= 500 or broke:
            span.set_status(Status(StatusCode.ERROR, error or str(record.status)))
        span.end(end_time=self.ns(record.ended_at))

    # Its attempts.

    def sending(self, attempt: Attempt, record: RequestRecord) -> tuple[bytes, bytes] | None:
        links = None
        if record.primary is not None:  # a shadow copy: a trace of its own, linked
            primary = record.primary.trace
            parent = _EMPTY
            if primary is not None and primary.get_span_context().is_valid:
                links = [Link(primary.get_span_context(), {"llm_gateway.link": "primary"})]
        elif record.trace is not None:
            if not record.trace.is_recording():  # not sampled: ids only, no SDK
                span = attempt.trace = _unsampled(record.trace.get_span_context().trace_id)
                return _traceparent(span)
            parent = trace.set_span_in_context(record.trace, _EMPTY)
        else:
            return None
        queued = attempt.placement.queued_for
        if queued and record.trace is not None and record.trace.is_recording():
            self.tracer.start_span("queue", context=parent,
                                   start_time=self.ns(attempt.sent_at - queued)
                                   ).end(end_time=self.ns(attempt.sent_at))
        replica = attempt.replica
        host, port = self._address(replica.url)
        attributes: dict[str, Any] = {"gen_ai.provider.name": replica.engine,
                                      "server.address": host, "server.port": port,
                                      "llm_gateway.replica": replica.name,
                                      "llm_gateway.pool": replica.pool,
                                      "llm_gateway.attempt": len(record.attempts)}
        if record.primary is not None:
            attributes["llm_gateway.role"] = "shadow"
        if record.request is not None:
            attributes.update(_request_attributes(record))
        span = self.tracer.start_span(
            f"{_operation(record)} {replica.model}", context=parent, kind=SpanKind.CLIENT,
            links=links, start_time=self.ns(attempt.sent_at), attributes=attributes)
        attempt.trace = span
        return _traceparent(span)

    def ended(self, attempt: Attempt) -> None:
        span = attempt.trace
        if span is None:
            return  # never sent (its translation failed), or tracing has no parent for it
        attempt.trace = None
        if span.is_recording():
            attributes: dict[str, Any] = {"http.response.status_code": attempt.status}
            attributes.update(_usage_attributes(attempt))
            if attempt.first_at is not None:
                span.add_event("first_token", timestamp=self.ns(attempt.first_at))
                attributes["llm_gateway.ttft_s"] = attempt.first_at - attempt.arrival
                decode = attempt.decode
                if decode is not None:
                    attributes["llm_gateway.itl_mean_s"] = decode[0]
            if attempt.error is not None:
                attributes["error.type"] = attempt.error.label
                span.set_status(Status(StatusCode.ERROR, attempt.error.label))
            if attempt.broke is not None:  # its stream broke after its first token
                attributes["llm_gateway.stream_broke"] = attempt.broke
            if attempt.migration is not None:  # it continues one that broke
                attributes["llm_gateway.continues_tokens"] = attempt.migration.carried
            span.set_attributes(attributes)
        span.end(end_time=self.ns(attempt.ended_at))

    async def aclose(self) -> None:
        """Export what is left and stop the exporter (off the loop: an export may block)."""
        await asyncio.to_thread(self.provider.shutdown)


def _traceparent(span: Any) -> tuple[bytes, bytes]:
    context = span.get_span_context()
    return (b"traceparent", f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                            f"{int(context.trace_flags):02x}".encode())


def _request_attributes(record: RequestRecord) -> dict[str, Any]:
    """What both the request's and its attempts' spans say of the request."""
    request = record.request
    assert request is not None
    attributes: dict[str, Any] = {"gen_ai.operation.name": _operation(record)}
    if request.model is not None:
        attributes["gen_ai.request.model"] = request.model
    elif record.model is not None:  # TGI names no model: the one it was served by
        attributes["gen_ai.request.model"] = record.model
    return attributes


def _usage_attributes(attempt: Attempt) -> dict[str, Any]:
    usage = attempt.usage
    attributes: dict[str, Any] = {}
    if usage.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
    if usage.completion_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
    if usage.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [usage.finish_reason]
    return attributes


def from_config(config: TracingConfig) -> Tracing:
    """Tracing as configured: the SDK's provider and the sampling ratio."""
    ratio = config.sampling if config.sampling is not None else env_ratio()
    return Tracing(provider_from(config), ratio)


def provider_from(config: TracingConfig) -> "TracerProvider":
    """The SDK's provider: OTLP/HTTP exporter behind a batch processor (the export runs on
    the processor's thread, never on the event loop). Its sampler is parent-based and always
    on for roots: ``Tracing`` has made the ratio's decision before it calls the SDK.

    Config values win; unset ones follow the SDK's environment variables
    (``OTEL_EXPORTER_OTLP_*``, ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*``)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    attributes = {}
    service = config.service_name or os.environ.get("OTEL_SERVICE_NAME") or "llm-gateway"
    attributes[SERVICE_NAME] = service
    provider = TracerProvider(resource=Resource.create(attributes),
                              sampler=ParentBased(ALWAYS_ON))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
    return provider


def env_ratio() -> float:
    """OTEL_TRACES_SAMPLER_ARG as a ratio (1.0 when unset)."""
    text = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not text:
        return 1.0
    try:
        ratio = float(text)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {text!r}")
    return ratio
