"""The request metrics listen: a client request's refusal and an API key's requests are
counted from its record when the edge tells the listeners it ended."""

from __future__ import annotations

from gateway.dataplane.listeners import RequestMetrics
from gateway.dataplane.outcome import Outcomes, Refusal, RequestRecord
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import Api
from gateway.protocol.reasons import Reason
from gateway.protocol.usage import Usage


def counted(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_refusals_and_key_requests_are_counted_from_the_record() -> None:
    metrics = GatewayMetrics()
    outcomes = Outcomes([RequestMetrics(metrics)])
    assert outcomes.ends and not outcomes.starts  # the edge skips the start call
    # Refused before admission: by model label and the client's protocol, and per key.
    refused = RequestRecord("a", Api.OPENAI, "/generate", 1.0, key="team",
                            refusal=Refusal(Reason.RATE_LIMITED, "m", Api.TGI))
    # No key at all: an unauthorized request counts under the empty key.
    anonymous = RequestRecord("b", Api.OPENAI, "/v1/completions", 1.0,
                              refusal=Refusal(Reason.UNAUTHORIZED, "unknown", Api.OPENAI))
    # Admitted and answered: the key's request and tokens; admitted but not answered: the
    # request alone.
    served = RequestRecord("c", Api.OPENAI, "/v1/completions", 1.0, key="team", model="m",
                           admitted_at=1.1, usage=Usage(7, 3))
    failed = RequestRecord("d", Api.OPENAI, "/v1/completions", 1.0, key="team", model="m",
                           admitted_at=1.1)
    for record in (refused, anonymous, served, failed):
        outcomes.request_ended(record)
    assert counted(metrics, "llm_gateway_rejections_total", model="m", api="tgi",
                   reason="rate_limited") == 1
    assert counted(metrics, "llm_gateway_key_rejections_total", key="team", model="m",
                   reason="rate_limited") == 1
    assert counted(metrics, "llm_gateway_key_rejections_total", key="", model="unknown",
                   reason="unauthorized") == 1
    assert counted(metrics, "llm_gateway_key_requests_total", key="team", model="m") == 2
    assert counted(metrics, "llm_gateway_key_prompt_tokens_total", key="team", model="m") == 7
    assert refused.error == "rate_limited" and served.error is None
