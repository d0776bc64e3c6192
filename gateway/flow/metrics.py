"""Latency objectives, for Prometheus, and the latency models' lessons: a listener of the
outcomes (``gateway.dataplane.outcome``), told once per attempt that ends.

- ``llm_gateway_objective_requests_total{model, priority, outcome=met|missed}``: completed
  requests that had a latency objective (``x-slo-ttft-ms``/``x-slo-tpot-ms`` or a default).
  Goodput is the rate of ``met``. TTFT is the client's: from arrival, queueing included; a
  non-streamed answer's first token is its whole answer. TPOT is judged on streams.
- ``llm_gateway_latency_prediction_error_ratio{model, kind=ttft|tpot}``: |predicted -
  measured| / measured, of streamed requests placed with a prediction.
- ``llm_gateway_waiting_requests{model, priority}``: requests waiting at the gateway now (for
  a free or unsaturated replica), read when scraped; ``model`` is the queue's (a P/D model's
  prefills wait in ``"<model> (prefill)"``).

Each streamed request that completes teaches its pool's latency model what its placement's
features gave (``gateway.flow.latency_model``), whether or not it had an objective.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.dataplane.outcome import Attempt, Listener
from gateway.flow.latency_model import LatencyModels
from gateway.metrics import GatewayMetrics

ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


class ObjectiveMetrics(Listener):
    def __init__(self, metrics: GatewayMetrics, models: LatencyModels | None,
                 queued: Callable[[], dict[tuple[str, int], int]] = dict) -> None:
        self.models = models
        self.queued = queued
        r = metrics.registry or CollectorRegistry()  # metrics off: counted nowhere visible
        self.waiting = Gauge("llm_gateway_waiting_requests", "Requests waiting at the gateway "
                             "for a replica with room, by priority band.", ("model", "priority"),
                             multiprocess_mode="livesum", registry=r)
        metrics.read_on_scrape(self._read_waiting)
        self.requests = Counter("llm_gateway_objective_requests", "Completed requests with a "
                                "latency objective, by whether they met it (goodput: the rate "
                                "of met).", ("model", "priority", "outcome"), registry=r)
        self.error = Histogram("llm_gateway_latency_prediction_error_ratio", "|predicted - "
                               "measured| / measured TTFT (from placement) and TPOT of streamed "
                               "requests.", ("model", "kind"), buckets=ERROR_BUCKETS,
                               registry=r)

    def _read_waiting(self) -> None:
        for (model, band), n in self.queued().items():  # a band that emptied reads 0
            self.waiting.labels(model, str(band)).set(n)

    def ended(self, attempt: Attempt) -> None:
        if attempt.request.shadow or not attempt.completed or attempt.migration is not None:
            return  # (a continuation's first token is not the request's, gateway.migrate)
        placement = attempt.placement
        decode = attempt.decode
        tpot = decode[0] if decode is not None else None
        objective = placement.objective
        if objective.timed:
            first = attempt.first_at if attempt.first_at is not None else attempt.ended_at
            met = ((objective.ttft_ms is None
                    or (first - attempt.arrival) * 1000 <= objective.ttft_ms)
                   and (objective.tpot_ms is None or tpot is None
                        or tpot * 1000 <= objective.tpot_ms))
            self.requests.labels(placement.model.name, str(objective.priority),
                                 "met" if met else "missed").inc()
        prediction = placement.prediction
        if self.models is None or prediction is None or attempt.first_at is None \
                or not attempt.sent_at:
            return
        ttft = attempt.first_at - attempt.sent_at
        for kind, predicted, measured in (("ttft", prediction.ttft, ttft),
                                          ("tpot", prediction.tpot, tpot)):
            if predicted is not None and measured:
                self.error.labels(placement.model.name, kind).observe(
                    abs(predicted - measured) / measured)
        self.models.of(placement.replica).observe(prediction.features, ttft, tpot)
