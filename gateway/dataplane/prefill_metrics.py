"""Disaggregated serving, for Prometheus: each prefill's time and outcome, the requests a
decode replica prefilled itself, and the hand-off from a prefill's answer to the decode
replica's first token. A listener of the outcomes (``gateway.dataplane.outcome``): told
once per prefill and once per streamed decode, never per token."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.dataplane.outcome import Attempt, Listener, Prefill
from gateway.dataplane.placement import Placement
from gateway.fleet.replica import Replica
from gateway.metrics import LATENCY_BUCKETS, REPLICA_GAUGE_LABELS, GatewayMetrics

PREFILL_OUTCOMES = ("ok", "failed", "refused", "abandoned")


def _labels(replica: Replica) -> tuple[str, str, str, str]:
    return replica.model, replica.pool, replica.name, replica.engine


class PrefillMetrics(Listener):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics  # a failed prefill is an upstream error of its replica
        r = metrics.registry or CollectorRegistry()  # metrics off: counted nowhere visible
        self.seconds = Histogram("llm_gateway_prefill_seconds", "A prefill replica's time to "
                                 "prefill a prompt for a decode replica: request sent to "
                                 "answer (answered ones).", REPLICA_GAUGE_LABELS,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.prefills = Counter("llm_gateway_prefills", "Prefills sent to a prefill replica, "
                                "by outcome (ok; failed: the replica failed it; refused: it "
                                "refused the request; abandoned: the client left).",
                                (*REPLICA_GAUGE_LABELS, "outcome"), registry=r)
        self.skipped = Counter("llm_gateway_prefill_skipped", "Requests a decode replica "
                               "prefilled itself, by reason (unavailable: no prefill replica "
                               "could take it; failed: those tried failed; whole_request: it "
                               "asks for the prompt's own logprobs).",
                               (*REPLICA_GAUGE_LABELS, "reason"), registry=r)
        self.handoff = Histogram("llm_gateway_kv_handoff_seconds", "From a prefill's answer "
                                 "to the decode replica's first token (the KV transfer and "
                                 "the decode's own queue), of streamed requests; by the decode "
                                 "replica.", REPLICA_GAUGE_LABELS, buckets=LATENCY_BUCKETS,
                                 registry=r)

    def prefilled(self, prefill: Prefill) -> None:
        labels = _labels(prefill.replica)
        if prefill.error is not None:
            outcome = "failed" if prefill.error.replica_fault else "refused"
            self.metrics.upstream_error(prefill.replica, prefill.error)
        elif 200 <= prefill.status < 300:
            outcome = "ok"
            self.seconds.labels(*labels).observe(prefill.seconds)
        else:
            outcome = "abandoned"
        self.prefills.labels(*labels, outcome).inc()

    def prefill_skipped(self, decode: Placement, reason: str) -> None:
        self.skipped.labels(*_labels(decode.replica), reason).inc()

    def first_token(self, attempt: Attempt) -> None:
        prefill = attempt.prefill
        if prefill is not None and attempt.first_at is not None:
            self.handoff.labels(*_labels(attempt.replica)).observe(
                attempt.first_at - prefill.ended_at)
