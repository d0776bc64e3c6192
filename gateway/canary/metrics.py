"""The canary's Prometheus metrics: pool weights, shadow copies, output agreement, the
guard's verdicts (on the gateway's registry, ``gateway.metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
SHADOW_SKIP_REASONS = ("in_flight_limit", "no_slot", "rejected")
PAIR_DROP_REASONS = ("too_long", "primary_failed", "shadow_failed")


class CanaryMetrics:
    """Canary comparison (gateway/canary): pool weights, shadow copies, output agreement.
    Per-request series of shadow copies are the ordinary ones with ``role="shadow"``."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()  # metrics off: counted nowhere visible
        self.pool_weight = Gauge("llm_gateway_pool_weight",
                                 "Weight of the pool in its model's traffic split (configured, "
                                 "or set at run time).", ("model", "pool"),
                                 multiprocess_mode="livemostrecent", registry=r)
        self.shadow_skipped = Counter("llm_gateway_shadow_skipped",
                                      "Shadow copies not sent, by reason (in_flight_limit: "
                                      "canary.max_shadow_in_flight reached; no_slot: every "
                                      "replica of the shadow pool at its in-flight limit; "
                                      "rejected: no replica of the shadow pool can take it).",
                                      ("model", "pool", "reason"), registry=r)
        self.verdict = Gauge("llm_gateway_canary_verdict",
                             "The canary guard's last judgment per metric (metric=\"verdict\": "
                             "overall): -1 insufficient data, 0 pass, 1 marginal, 2 fail.",
                             ("model", "baseline", "canary", "metric"),
                             multiprocess_mode="livemostrecent", registry=r)
        self.score = Gauge("llm_gateway_canary_score", "The canary guard's last score (0-100; "
                           "NaN while data is insufficient).", ("model", "baseline", "canary"),
                           multiprocess_mode="livemostrecent", registry=r)
        self.agreement = Gauge("llm_gateway_canary_agreement_ratio",
                               "The canary guard's last judged output agreement of a shadow "
                               "pool (metric: agreement or prefix_agreement; bound: estimate, "
                               "low and high of its interval, required: the floor or the "
                               "reference's agreement less the allowed drop).",
                               ("model", "baseline", "canary", "metric", "bound"),
                               multiprocess_mode="livemostrecent", registry=r)
        self.rollbacks = Counter("llm_gateway_canary_rollbacks",
                                 "Canary pools whose weight the automatic guard set to 0 "
                                 "after a failing verdict.", ("model", "pool"), registry=r)
        self.pairs = Counter("llm_gateway_shadow_pairs",
                             "Primary/shadow pairs whose generated texts were compared, by "
                             "result (agreed: the same text) and greedy (temperature 0).",
                             ("model", "pool", "greedy", "result"), registry=r)
        self.prefix_agreed = Counter("llm_gateway_shadow_pairs_prefix_agreed",
                                     "Compared pairs whose texts agree on their first "
                                     "canary.judge.agreement.prefix_chars characters (the "
                                     "prefix agreement the verdict judges).",
                                     ("model", "pool", "greedy"), registry=r)
        self.pairs_dropped = Counter("llm_gateway_shadow_pairs_dropped",
                                     "Primary/shadow pairs not compared, by reason.",
                                     ("model", "pool", "reason"), registry=r)
        self.common_prefix = Histogram("llm_gateway_shadow_common_prefix_ratio",
                                       "Common prefix of the two texts of a compared pair, as "
                                       "a share of the longer one (1 = identical).",
                                       ("model", "pool"), buckets=PREFIX_RATIO_BUCKETS,
                                       registry=r)

    def weight(self, model: str, pool: str, weight: float) -> None:
        self.pool_weight.labels(model, pool).set(weight)

    def start_at_zero(self, model: str, pool: str) -> None:
        """Series of a shadow pool that a healthy canary never increments."""
        for reason in SHADOW_SKIP_REASONS:
            self.shadow_skipped.labels(model, pool, reason)
        for reason in PAIR_DROP_REASONS:
            self.pairs_dropped.labels(model, pool, reason)
        for greedy in ("true", "false"):
            self.prefix_agreed.labels(model, pool, greedy)
            for result in ("agreed", "disagreed"):
                self.pairs.labels(model, pool, greedy, result)
