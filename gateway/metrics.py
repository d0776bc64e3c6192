"""Every Prometheus metric the gateway exports, in one place (prefix ``llm_gateway_``).

Label values come only from configuration (model, pool, replica, engine), the API and fixed
sets (status class, reasons, error kinds), never from client input, so a client cannot grow
the series count. Per-replica gauges are read from the ledger and fleet at scrape time, so
they cost nothing on the request path; the hot path uses label children bound once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.balance.ledger import LoadLedger
from gateway.fleet.replica import Replica
from gateway.protocol.errors import Api

# Request latencies: 1 ms .. 10 min. Inter-token: 1 ms .. 5 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   300.0, 600.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKENS_PER_SECOND_BUCKETS = (1, 5, 10, 20, 30, 40, 50, 60, 75, 100, 150, 200, 300, 500, 1000,
                             2000, 5000, 10000)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 0.5, 1.0)

REPLICA_LABELS = ("model", "pool", "replica", "engine", "api")
STATUS_CLASSES = ("2xx", "4xx", "5xx")


def status_class(status: int) -> str:
    return f"{min(max(status // 100, 2), 5)}xx"


@dataclass(slots=True)
class RequestMetrics:
    """The metric children of one (replica, api), bound once."""

    ttft: object
    itl: object
    e2e: object
    tokens_per_second: object
    overhead: object
    prompt_tokens: object
    generation_tokens: object
    requests: dict[str, object]


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("llm_gateway_time_to_first_token_seconds",
                              "Request arrival at the gateway to first token sent to the client.",
                              REPLICA_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llm_gateway_inter_token_latency_seconds",
                             "Mean gap between output tokens of each streamed request.",
                             REPLICA_LABELS, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("llm_gateway_e2e_request_latency_seconds",
                             "Request arrival to the last byte sent to the client.",
                             REPLICA_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Histogram(
            "llm_gateway_request_output_tokens_per_second",
            "Generated tokens / decode time (first to last token) of each request.",
            REPLICA_LABELS, buckets=TOKENS_PER_SECOND_BUCKETS, registry=r)
        self.overhead = Histogram("llm_gateway_added_latency_seconds",
                                  "Time the gateway adds: request arrival to upstream request sent.",
                                  REPLICA_LABELS, buckets=OVERHEAD_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llm_gateway_prompt_tokens",
                                     "Prompt tokens of served requests (engine usage).",
                                     REPLICA_LABELS, registry=r)
        self.generation_tokens = Counter("llm_gateway_generation_tokens",
                                         "Generated tokens sent to clients (engine usage).",
                                         REPLICA_LABELS, registry=r)
        self.requests = Counter("llm_gateway_requests",
                                "Requests forwarded to a replica, by final status class.",
                                (*REPLICA_LABELS, "status"), registry=r)
        self.rejections = Counter("llm_gateway_rejections",
                                  "Requests the gateway answered itself with an error, by reason.",
                                  ("model", "api", "reason"), registry=r)
        self.upstream_errors = Counter("llm_gateway_upstream_errors",
                                       "Failures talking to a replica, by kind.",
                                       ("model", "pool", "replica", "engine", "kind"), registry=r)
        self._bound: dict[tuple[str, Api], RequestMetrics] = {}

    def for_replica(self, replica: Replica, api: Api) -> RequestMetrics:
        bound = self._bound.get((replica.name, api))
        if bound is None:
            labels = (replica.model, replica.pool, replica.name, replica.engine, api.value)
            bound = self._bound[(replica.name, api)] = RequestMetrics(
                ttft=self.ttft.labels(*labels), itl=self.itl.labels(*labels),
                e2e=self.e2e.labels(*labels),
                tokens_per_second=self.tokens_per_second.labels(*labels),
                overhead=self.overhead.labels(*labels),
                prompt_tokens=self.prompt_tokens.labels(*labels),
                generation_tokens=self.generation_tokens.labels(*labels),
                requests={c: self.requests.labels(*labels, c) for c in STATUS_CLASSES})
        return bound

    def reject(self, model: str, api: Api, reason: str) -> None:
        self.rejections.labels(model, api.value, reason).inc()

    def upstream_error(self, replica: Replica, kind: str) -> None:
        self.upstream_errors.labels(replica.model, replica.pool, replica.name, replica.engine,
                                    kind).inc()

    def watch_replicas(self, replicas: Callable[[], Iterable[Replica]], ledger: LoadLedger) -> None:
        """Export per-replica load and state, read at scrape time."""
        self.registry.register(_ReplicaStateCollector(replicas, ledger))


class _ReplicaStateCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable[Replica]], ledger: LoadLedger) -> None:
        self.replicas = replicas
        self.ledger = ledger

    def collect(self) -> Iterable[Metric]:
        labels = ["model", "pool", "replica", "engine"]
        outstanding = GaugeMetricFamily("llm_gateway_replica_outstanding_tokens",
                                        "Prompt tokens not yet prefilled + output tokens still "
                                        "expected, over in-flight requests.", labels=labels)
        in_flight = GaugeMetricFamily("llm_gateway_replica_in_flight_requests",
                                      "Requests in flight on the replica.", labels=labels)
        healthy = GaugeMetricFamily("llm_gateway_replica_healthy",
                                    "1 if the replica passes its health checks.", labels=labels)
        window = GaugeMetricFamily("llm_gateway_replica_max_model_len",
                                   "Context window of the replica (configured or discovered).",
                                   labels=labels)
        for replica in self.replicas():
            values = [replica.model, replica.pool, replica.name, replica.engine]
            load = self.ledger.load(replica.name)
            outstanding.add_metric(values, load.outstanding_tokens)
            in_flight.add_metric(values, load.in_flight)
            healthy.add_metric(values, 1.0 if replica.healthy else 0.0)
            if replica.max_model_len is not None:
                window.add_metric(values, replica.max_model_len)
        return [outstanding, in_flight, healthy, window]
