"""Streams continued on another replica, for Prometheus: a listener of the outcomes
(``gateway.dataplane.outcome``), told once per client request that ends.

- ``llm_gateway_migrations_total{model, reason, exact}``: continuations that took over a
  broken stream, by why it broke (``disconnect``: the connection lost or closed early;
  ``error_event``: the engine's error event; ``stall``: its engine hung; ``timeout``: the
  stream alone silent past ``timeouts.between_tokens``) and whether the continuation is exact
  (``true``: from token ids, and any tokens generated again the ones the client had).
- ``llm_gateway_migrated_tokens_total{model}``: generated tokens handed to continuations.
- ``llm_gateway_migration_gap_seconds{model}``: from the last token before the break to the
  first after it (detection, placement and the new replica's prefill of prompt and tokens).
- ``llm_gateway_streams_not_continued_total{model, reason}``: broken streams that ended with
  an error event instead, by why (``gateway.migrate.exactness.NotContinued``).
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.dataplane.outcome import Listener, RequestRecord
from gateway.metrics import GatewayMetrics
from gateway.migrate.exactness import NotContinued

BREAK_REASONS = ("disconnect", "error_event", "stall", "timeout")
GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class MigrationMetrics(Listener):
    def __init__(self, metrics: GatewayMetrics, models: Iterable[str] = ()) -> None:
        r = metrics.registry or CollectorRegistry()  # metrics off: counted nowhere visible
        self.migrations = Counter("llm_gateway_migrations", "Broken streams continued on "
                                  "another replica, by why they broke.",
                                  ("model", "reason", "exact"), registry=r)
        self.tokens = Counter("llm_gateway_migrated_tokens", "Generated tokens handed to a "
                              "continuation on another replica.", ("model",), registry=r)
        self.gap = Histogram("llm_gateway_migration_gap_seconds", "From the last token before "
                             "a stream broke to the first of its continuation.", ("model",),
                             buckets=GAP_BUCKETS, registry=r)
        self.not_continued = Counter("llm_gateway_streams_not_continued", "Streams that broke "
                                     "after their first token and ended with an error event, "
                                     "by why they could not go on elsewhere.",
                                     ("model", "reason"), registry=r)
        for model in models:
            for reason in BREAK_REASONS:
                self.migrations.labels(model, reason, "true")
            self.tokens.labels(model)
            for why in NotContinued:
                self.not_continued.labels(model, why.label)

    def request_ended(self, record: RequestRecord) -> None:
        for attempt in record.attempts:
            model = attempt.placement.model.name
            migration = attempt.migration
            if migration is not None and attempt.answered:
                self.migrations.labels(model, migration.broken.broke,
                                       "true" if migration.exact else "false").inc()
                self.tokens.labels(model).inc(migration.carried)
                if attempt.first_at is not None and migration.broken.last_at is not None:
                    self.gap.labels(model).observe(attempt.first_at - migration.broken.last_at)
            if attempt.not_continued is not None:
                self.not_continued.labels(model, attempt.not_continued).inc()
