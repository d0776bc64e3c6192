"""The retry loop without sockets: a real placer, a relay that plays a script of failures.
Which failures are retried is the failure kind's (``retryable``), bounded by the attempts
allowed, the replicas left and the retry budget; a retry is told to the listeners on the
failed attempt, where metrics count it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import make_policy
from gateway.dataplane.attempts import Attempts
from gateway.dataplane.listeners import RequestMetrics
from gateway.dataplane.outcome import Attempt, Listener, Outcomes, RequestRecord
from gateway.dataplane.placement import Placement
from gateway.dataplane.reply import Reply
from gateway.dataplane.retry_budget import RetryBudget
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.fleet.role import Role
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import (Api, EngineError, GatewayError, InvalidRequest,
                                     UpstreamTimeout, UpstreamUnavailable)
from gateway.protocol.openai import parse_completion
from gateway.protocol.request import NO_CONTEXT, GenerationRequest
from gateway.upstream.failure import FailureKind
from routing import Routing


class ScriptedRelay:
    """Answers each attempt with the next entry of ``script`` (an error, or None: a reply),
    recording and ending the attempt as the real relay does."""

    def __init__(self, script: list[GatewayError | None], outcomes: Outcomes) -> None:
        self.script = list(script)
        self.outcomes = outcomes
        self.prefills: list[object] = []  # the prefill each attempt was sent with

    async def forward(self, request: GenerationRequest, placement: Placement,
                      record: RequestRecord, prefill: object = None) -> Reply:
        self.prefills.append(prefill)
        attempt = Attempt(request, placement, record.arrival)
        record.attempts.append(attempt)
        placement.lease.close()
        error = self.script.pop(0)
        attempt.end(error.status if error else 200, error.failure if error else None)
        self.outcomes.ended(attempt)
        if error is not None:
            raise error
        return Reply(200, [], body=b"{}")


class Retries(Listener):
    def __init__(self) -> None:
        self.heard: list[tuple[str, FailureKind | None]] = []

    def retried(self, attempt: Attempt) -> None:
        self.heard.append((attempt.replica.name, attempt.error))


class CountingPrefiller:
    """Hands every decode replica a prefill of its own, and counts them."""

    def __init__(self) -> None:
        self.made: list[object] = []

    async def prefill(self, request: GenerationRequest, decode: Placement, request_id: str,
                      key: object = None, caller: object = None) -> object:
        decode.lease.first_token()
        self.made.append(object())
        return self.made[-1]


class Setup:
    def __init__(self, script: list[GatewayError | None], replicas: int = 3,
                 max_attempts: int = 3, budget: RetryBudget | None = None,
                 role: str = "both") -> None:
        self.replicas = [Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}", "vllm", "m", "default",
                                 role=role) for i in range(replicas)]
        self.prefiller = CountingPrefiller()
        model = ServedModel("m", [Pool("default", 100, self.replicas)], None, 4096, 16)
        self.routing = Routing({"m": model}, make_policy("round_robin"), InProcessLedger())
        self.metrics = GatewayMetrics()
        self.retries = Retries()
        outcomes = Outcomes([RequestMetrics(self.metrics), self.retries])
        relay, shadows = ScriptedRelay(script, outcomes), SimpleNamespace(models=set())
        self.relay = relay
        self.attempts = Attempts(self.routing.placer, relay,  # type: ignore[arg-type]
                                 budget or RetryBudget(1.0, 10.0), max_attempts, outcomes,
                                 shadows, self.prefiller)  # type: ignore[arg-type]
        self.record = RequestRecord("id", Api.OPENAI, "/v1/completions", time.perf_counter())

    async def serve(self) -> Reply:
        request = parse_completion(b'{"model": "m", "prompt": "hi", "max_tokens": 8}')
        model, admission = self.routing.admit(request)
        return await self.attempts.serve(request, NO_CONTEXT, model, admission, self.record)

    def retries_counted(self, replica: str, kind: str) -> float:
        return self.metrics.registry.get_sample_value(
            "llm_gateway_retries_total", {"model": "m", "pool": "default", "replica": replica,
                                          "engine": "vllm", "kind": kind}) or 0.0


def unavailable(kind: FailureKind) -> UpstreamUnavailable:
    return UpstreamUnavailable("replica failed", kind)


async def test_a_retryable_failure_is_retried_elsewhere_and_counted_by_the_listener() -> None:
    s = Setup([unavailable(FailureKind.CONNECT), None])
    reply = await s.serve()
    assert reply.status == 200
    first, second = s.record.attempts
    assert first.replica is not second.replica
    assert first.retried and first.error is FailureKind.CONNECT and not second.retried
    assert s.retries.heard == [(first.replica.name, FailureKind.CONNECT)]
    assert s.retries_counted(first.replica.name, "connect") == 1


@pytest.mark.parametrize("kind, label", [(FailureKind.HTTP_429, "http_429"),
                                         (FailureKind.HTTP_5XX, "http_5xx"),
                                         (FailureKind.STREAM_BROKEN, "transport")])
async def test_retry_labels_come_from_the_failure_kind(kind: FailureKind, label: str) -> None:
    error = (EngineError("busy", 429) if kind is FailureKind.HTTP_429
             else EngineError("boom", 500) if kind is FailureKind.HTTP_5XX else unavailable(kind))
    assert error.failure is kind  # set where the error was made
    s = Setup([error, None])
    await s.serve()
    assert s.retries_counted(s.record.attempts[0].replica.name, label) == 1


@pytest.mark.parametrize("error", [UpstreamTimeout("slow"), EngineError("bad", 400),
                                   InvalidRequest("the plan refused it"),
                                   unavailable(FailureKind.BAD_RESPONSE)])
async def test_a_failure_that_is_not_retryable_is_raised_at_once(error: GatewayError) -> None:
    s = Setup([error, None])
    with pytest.raises(GatewayError) as raised:
        await s.serve()
    assert raised.value is error
    assert len(s.record.attempts) == 1 and not s.record.attempts[0].retried
    assert s.retries.heard == []


async def test_attempts_stop_at_the_limit_and_the_last_failure_is_raised() -> None:
    last = EngineError("boom", 503)
    s = Setup([EngineError("boom", 500), last, None], replicas=3, max_attempts=2)
    with pytest.raises(EngineError) as raised:
        await s.serve()
    assert raised.value is last
    assert [a.retried for a in s.record.attempts] == [True, False]
    assert len({a.replica.name for a in s.record.attempts}) == 2


async def test_no_retry_without_another_available_replica_or_budget() -> None:
    alone = Setup([unavailable(FailureKind.TRANSPORT), None], replicas=1)
    with pytest.raises(UpstreamUnavailable):
        await alone.serve()
    spent = Setup([unavailable(FailureKind.TRANSPORT), None],
                  budget=RetryBudget(ratio=0.0, min_per_second=0.0))
    with pytest.raises(UpstreamUnavailable):
        await spent.serve()
    assert len(alone.record.attempts) == len(spent.record.attempts) == 1
    assert alone.retries.heard == spent.retries.heard == []


async def test_a_decode_retry_reuses_the_prefill_only_when_the_failure_never_reached_the_engine(
        ) -> None:
    refused = Setup([unavailable(FailureKind.CONNECT), None], role="decode")
    await refused.serve()
    # No connection: the KV is where the prefill left it, for the next decode replica.
    assert len(refused.prefiller.made) == 1
    assert refused.relay.prefills == [refused.prefiller.made[0]] * 2
    for error in (EngineError("boom", 503), unavailable(FailureKind.STREAM_BROKEN)):
        reached = Setup([error, None], role="decode")
        await reached.serve()
        # The engine had the request: it may have taken the KV; the next one gets a new one.
        assert len(reached.prefiller.made) == 2
        assert reached.relay.prefills == reached.prefiller.made
    whole = Setup([None])  # ordinary replicas: no prefill
    await whole.serve()
    assert whole.prefiller.made == [] and whole.relay.prefills == [None]
    assert all(s.routing.ledger.load(r.name).in_flight == 0
               for s in (refused, whole) for r in s.replicas)


async def test_prefill_replicas_are_not_left_to_retry_an_answer_on() -> None:
    last = EngineError("boom", 503)
    s = Setup([last, None], role="decode")
    for prefill_only in s.replicas[1:]:
        prefill_only.role = Role.PREFILL
    with pytest.raises(EngineError) as raised:  # the engine's failure, not "no replica"
        await s.serve()
    assert raised.value is last
    assert [a.replica.name for a in s.record.attempts] == ["r0"]
