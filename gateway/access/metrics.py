"""The Prometheus metrics of API key limits shared through Redis (on the gateway's registry,
``gateway.metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AccessMetrics:
    """API key limits shared through Redis (``auth`` and ``redis_url`` set)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.shared_up = Gauge("llm_gateway_access_limits_shared_up",
                               "1 while API key limits are checked in Redis (shared by every "
                               "instance); 0 while Redis is unreachable (each instance limits "
                               "on its own, or refuses with auth.fail_closed).",
                               multiprocess_mode="livemin", registry=registry)
        self.shared_failures = Counter("llm_gateway_access_limits_shared_failures",
                                       "Admissions or settlements of API key limits that Redis "
                                       "did not answer.", registry=registry)
