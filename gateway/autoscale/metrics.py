"""The autoscale signal for Prometheus, set from an evaluation before each scrape.

- ``llm_gateway_desired_replicas{model, pool, role}``: replicas' worth of demand, smoothed
  (up at once, down after ``autoscale.scale_down_after``); not rounded: several instances (or
  workers) each publish their share, and an autoscaler rounds the sum up (KEDA's
  ``AverageValue`` 1). Above 0 whenever anything was offered or is held.
- Its inputs, so an operator sees why: ``llm_gateway_autoscale_offered_tokens_per_second
  {kind=prompt|output}``, ``..._arrivals_per_second``, ``..._concurrent_requests`` (running
  and waiting now), ``..._replica_capacity_requests`` (requests a replica is sized to run
  at once: headroom below the operating point), ``..._request_seconds`` (what each then takes),
  ``..._replica_output_tokens_per_second`` (what a replica serves there),
  ``..._raw_desired_replicas`` (before smoothing), ``..._replicas`` (taking requests now).
- ``llm_gateway_scale_down_candidate{model, pool, role, replica}``: when fewer replicas are
  wanted, the ones to remove, cheapest first (1 = the first); no series otherwise.
- ``llm_gateway_held_requests{model}``: requests held for a replica to appear (scale from zero).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Gauge

from gateway.autoscale.autoscaler import Autoscaler, GroupSignal

LABELS = ("model", "pool", "role")


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry | None, autoscaler: Autoscaler,
                 held: Callable[[], dict[str, int]]) -> None:
        r = registry or CollectorRegistry()  # metrics off: counted nowhere visible
        self.autoscaler = autoscaler
        self.held_by_model = held

        def gauge(name: str, text: str, labels: tuple[str, ...] = LABELS,
                  mode: str = "livesum") -> Gauge:
            return Gauge(name, text, labels, multiprocess_mode=mode, registry=r)

        self.desired = gauge("llm_gateway_desired_replicas", "Replicas the pool (and role) "
                             "needs to meet its latency objectives at the recent load, with "
                             "headroom; smoothed, unrounded (round the fleet's sum up).")
        self.raw = gauge("llm_gateway_autoscale_raw_desired_replicas", "The desired replicas "
                         "of the latest evaluation, before smoothing.")
        self.offered = gauge("llm_gateway_autoscale_offered_tokens_per_second", "Tokens per "
                             "second offered to the pool lately (kind: prompt, output).",
                             (*LABELS, "kind"))
        self.arrivals = gauge("llm_gateway_autoscale_arrivals_per_second", "Requests per "
                              "second offered to the pool lately (its share of the model's).")
        self.concurrent = gauge("llm_gateway_autoscale_concurrent_requests", "Requests of the "
                                "pool running or waiting now.")
        self.capacity = gauge("llm_gateway_autoscale_replica_capacity_requests", "Requests "
                              "one replica is sized to run at once: headroom below the most "
                              "predicted to meet the objectives.", mode="livemax")
        self.seconds = gauge("llm_gateway_autoscale_request_seconds", "Seconds a request "
                             "takes on a replica running that many (predicted, else "
                             "measured).", mode="livemax")
        self.throughput = gauge("llm_gateway_autoscale_replica_output_tokens_per_second",
                                "Output tokens per second one replica serves running that "
                                "many.", mode="livemax")
        self.replicas = gauge("llm_gateway_autoscale_replicas", "Replicas of the pool taking "
                              "requests now.", mode="livemax")
        self.candidate = gauge("llm_gateway_scale_down_candidate", "Replicas to remove when "
                               "fewer are wanted, cheapest first (1 = the first).",
                               (*LABELS, "replica"), mode="livemostrecent")
        self.held = gauge("llm_gateway_held_requests", "Requests held at the gateway for a "
                          "replica to appear (scale from zero).", ("model",))
        self._candidates: set[tuple[str, ...]] = set()
        self._held_models: set[str] = set()

    def read(self) -> None:
        """Evaluate now and set every gauge (read before each scrape)."""
        for signal in self.autoscaler.evaluate():
            self._set(signal)
        held = self.held_by_model()
        for model in self._held_models | set(held):
            self.held.labels(model).set(held.get(model, 0))
        self._held_models = set(held)

    def _set(self, s: GroupSignal) -> None:
        labels = (s.model, s.pool, s.role.value)
        demand, point = s.demand, s.point
        self.desired.labels(*labels).set(s.desired)
        self.raw.labels(*labels).set(s.raw)
        self.offered.labels(*labels, "prompt").set(demand.arrivals * demand.prompt_tokens)
        self.offered.labels(*labels, "output").set(demand.arrivals * demand.output_tokens)
        self.arrivals.labels(*labels).set(demand.arrivals)
        self.concurrent.labels(*labels).set(demand.in_flight + demand.waiting)
        self.capacity.labels(*labels).set(point.in_flight)
        self.seconds.labels(*labels).set(s.request_seconds)
        self.throughput.labels(*labels).set(
            point.in_flight * demand.output_tokens / s.request_seconds if s.request_seconds
            else 0.0)
        self.replicas.labels(*labels).set(s.replicas)
        named = {(*labels, name) for name in s.candidates}
        for stale in {c for c in self._candidates if c[:3] == labels} - named:
            self.candidate.remove(*stale)
            self._candidates.discard(stale)
        for rank, name in enumerate(s.candidates, 1):
            self.candidate.labels(*labels, name).set(rank)
            self._candidates.add((*labels, name))
