"""A loopback OTLP/HTTP trace receiver for tests: what a collector would get, decoded from
the real protobuf (``opentelemetry-proto``'s ExportTraceServiceRequest).

No OpenTelemetry Collector binary can be installed here; this stands in for its
``otlphttp`` receiver: ``POST /v1/traces`` with ``application/x-protobuf`` (gzip or not).
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from support import wait_until

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: str
    start: int  # epoch ns
    end: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: bool = False


class OtlpReceiver:
    """``with OtlpReceiver() as otlp:``; ``otlp.url`` is the traces endpoint."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.bad: list[str] = []  # bodies that did not decode: a test failure
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                status = 200
                try:
                    if self.path != "/v1/traces":
                        raise ValueError(f"path {self.path}")
                    receiver._take(ExportTraceServiceRequest.FromString(body))
                except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                    receiver.bad.append(repr(exc))
                    status = 400
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

    def _take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(Span(
                        service, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.name, KINDS.get(s.kind, str(s.kind)), s.start_time_unix_nano,
                        s.end_time_unix_nano, {kv.key: _value(kv.value) for kv in s.attributes},
                        [(e.name, e.time_unix_nano) for e in s.events],
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        s.status.code == 2))
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout: float = 15.0,
                 what: str = "spans") -> list[Span]:
        """The spans once ``predicate`` holds for them (polled), else AssertionError."""
        spans: list[Span] = []

        def holds() -> bool:
            spans[:] = self.snapshot()
            assert not self.bad, self.bad
            return predicate(spans)

        wait_until(holds, timeout,
                   lambda: f"{what}; have {sorted({(s.service, s.name) for s in spans})}")
        return spans


def children(spans: list[Span], parent: Span) -> Iterator[Span]:
    return (s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id)
