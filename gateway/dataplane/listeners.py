"""The listeners registered at wiring: each turns an attempt's outcome into what its own
part of the gateway keeps (``gateway.dataplane.outcome``)."""

from __future__ import annotations

from gateway.canary.samples import SampleBook
from gateway.dataplane.outcome import Attempt, Listener, Prefill, RequestRecord
from gateway.fleet.outlier import OutlierDetector
from gateway.fleet.response_homes import ResponseHomes
from gateway.metrics import GatewayMetrics, status_class
from gateway.protocol.reasons import Reason


class RequestMetrics(Listener):
    """TTFT when the first token comes; a retry when one follows a failed attempt; the rest
    (queueing, status, failure kind, latencies, tokens) when the attempt ends; the gateway's
    refusals and each API key's requests when the client request ends."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def first_token(self, attempt: Attempt) -> None:
        meter = self.metrics.for_replica(attempt.replica, attempt.request.api, attempt.role,
                                         attempt.placement.name, attempt.request.path)
        meter.ttft.observe(attempt.first_at - attempt.arrival)  # type: ignore[operator]

    def ended(self, attempt: Attempt) -> None:
        metrics = self.metrics
        meter = metrics.for_replica(attempt.replica, attempt.request.api, attempt.role,
                                    attempt.placement.name, attempt.request.path)
        if attempt.sent_at and attempt.migration is None:  # (a continuation's is not ours)
            meter.overhead.observe(attempt.sent_at - attempt.arrival)
        placement = attempt.placement
        if placement.queued_for:
            metrics.queued(placement.model.name, attempt.request.api, placement.queued_for)
            if placement.caller is not None:
                metrics.key_queued(placement.caller.name, placement.model.name,
                                   placement.queued_for)
        meter.requests[status_class(attempt.status)].inc()
        if attempt.error is not None:
            metrics.upstream_error(attempt.replica, attempt.error)
        if not attempt.answered:
            return
        meter.e2e.observe(attempt.ended_at - attempt.arrival)
        usage = attempt.usage
        if usage.prompt_tokens:
            meter.prompt_tokens.inc(usage.prompt_tokens)
        if usage.completion_tokens:
            meter.generation_tokens.inc(usage.completion_tokens)
        decode = attempt.decode
        if decode is not None:
            meter.itl.observe(decode[0])
            meter.tokens_per_second.observe(decode[1])

    def retried(self, attempt: Attempt) -> None:
        self.metrics.retry(attempt.replica, attempt.error)  # type: ignore[arg-type]

    def request_ended(self, record: RequestRecord) -> None:
        refusal, key = record.refusal, record.key
        if refusal is not None:
            self.metrics.reject(refusal.model, refusal.api, refusal.reason)
            if key is not None:
                self.metrics.key_rejected(key, refusal.model, refusal.reason)
            elif refusal.reason == Reason.UNAUTHORIZED:
                self.metrics.key_rejected("", refusal.model, refusal.reason)
        if key is not None and record.admitted_at:  # admitted: its grant was settled
            self.metrics.key_done(key, record.model, record.usage)  # type: ignore[arg-type]


class OutlierRecord(Listener):
    """Each attempt's failure or success on its replica, for passive ejection
    (``gateway.fleet.outlier``). A shadow copy's attempts are not told: they never eject a
    replica nor clear its failures (how a copy went must not change how clients are
    served), though they count in the shadow's metrics and canary samples."""

    def __init__(self, outlier: OutlierDetector) -> None:
        self.outlier = outlier

    def ended(self, attempt: Attempt) -> None:
        if attempt.request.shadow:
            return
        if attempt.replica_failed:
            self.outlier.failure(attempt.replica)
        elif attempt.replica_served:
            self.outlier.success(attempt.replica)

    def prefilled(self, prefill: Prefill) -> None:
        if prefill.error is not None and prefill.error.replica_fault:
            self.outlier.failure(prefill.replica)
        elif prefill.error is None and 200 <= prefill.status < 300:
            self.outlier.success(prefill.replica)


class CanarySamples(Listener):
    """Each pool's recent requests, for the canary verdict."""

    def __init__(self, samples: SampleBook) -> None:
        self.samples = samples

    def ended(self, attempt: Attempt) -> None:
        replica = attempt.replica
        if attempt.status >= 500:
            self.samples.failed(replica.model, replica.pool)
        elif attempt.answered and attempt.status < 400:
            decode = attempt.decode
            ttft = None if attempt.first_at is None or attempt.migration is not None \
                else attempt.first_at - attempt.arrival  # (a continuation's is not a TTFT)
            self.samples.served(replica.model, replica.pool, ttft,
                                None if decode is None else decode[0],
                                attempt.ended_at - attempt.arrival,
                                None if decode is None else decode[1])


class OutputLengths(Listener):
    """What completed requests generated of what they asked (the balancer's estimate);
    an error or a disconnect says nothing about lengths."""

    def ended(self, attempt: Attempt) -> None:
        if attempt.completed:
            attempt.placement.served(attempt.usage.completion_tokens)


class ResponseHomesRecord(Listener):
    """Records the home of each response an attempt stored (its answer named one); a shadow
    copy's stored response is nobody's."""

    def __init__(self, homes: ResponseHomes) -> None:
        self.homes = homes

    def ended(self, attempt: Attempt) -> None:
        stored = attempt.usage.stored_id
        if stored is not None and attempt.answered and not attempt.request.shadow:
            self.homes.record(stored, attempt.replica.name)
