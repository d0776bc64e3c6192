"""A request's priority and latency objectives from its headers and its key's and model's
defaults (gateway/flow/objective.py): precedence, the key's ceiling, and each bad header a
400 naming it."""

from __future__ import annotations

import pytest

from gateway.config import ObjectiveConfig
from gateway.flow.objective import (DEFAULT_OBJECTIVE, NO_HEADERS, Objective, ObjectiveHeaders,
                                    PriorityNotAllowed, resolve)
from gateway.api.intake import read_headers
from gateway.protocol.errors import InvalidRequest


def test_nothing_set_is_priority_0_without_objectives() -> None:
    assert resolve(NO_HEADERS, None, None, None) is DEFAULT_OBJECTIVE
    assert not DEFAULT_OBJECTIVE.sheddable and not DEFAULT_OBJECTIVE.timed


def test_headers_then_the_keys_defaults_then_the_models() -> None:
    key = ObjectiveConfig(priority=1, ttft_ms=300)
    model = ObjectiveConfig(priority=-1, ttft_ms=2000, tpot_ms=50)
    assert resolve(NO_HEADERS, key, 1, model) == Objective(1, 300.0, 50.0)
    assert resolve(NO_HEADERS, None, None, model) == Objective(-1, 2000.0, 50.0)
    sent = ObjectiveHeaders(b"-1", b"250", b" 20 ", b"true")
    assert resolve(sent, key, 1, model) == Objective(-1, 250.0, 20.0, strict=True)
    assert resolve(sent, key, 1, model).sheddable


def test_a_key_may_not_raise_its_priority_above_its_ceiling() -> None:
    with pytest.raises(PriorityNotAllowed) as refused:
        resolve(ObjectiveHeaders(b"2"), ObjectiveConfig(priority=1), 1, None)
    assert refused.value.status == 403 and "above 1" in refused.value.message
    # Lowering it is always allowed; without keys any priority in range may be asked.
    assert resolve(ObjectiveHeaders(b"-5"), None, 0, None).priority == -5
    assert resolve(ObjectiveHeaders(b"100"), None, None, None).priority == 100


@pytest.mark.parametrize("headers, named", [
    (ObjectiveHeaders(priority=b"high"), "x-gateway-priority"),
    (ObjectiveHeaders(priority=b"1.5"), "x-gateway-priority"),
    (ObjectiveHeaders(priority=b"101"), "x-gateway-priority"),
    (ObjectiveHeaders(priority=b"-101"), "x-gateway-priority"),
    (ObjectiveHeaders(ttft_ms=b"fast"), "x-slo-ttft-ms"),
    (ObjectiveHeaders(ttft_ms=b"0"), "x-slo-ttft-ms"),
    (ObjectiveHeaders(ttft_ms=b"-3"), "x-slo-ttft-ms"),
    (ObjectiveHeaders(ttft_ms=b"nan"), "x-slo-ttft-ms"),
    (ObjectiveHeaders(tpot_ms=b"inf"), "x-slo-tpot-ms"),
    (ObjectiveHeaders(tpot_ms=b"1e12"), "x-slo-tpot-ms"),
    (ObjectiveHeaders(strict=b"maybe"), "x-slo-strict"),
])
def test_a_bad_header_is_a_400_naming_it(headers: ObjectiveHeaders, named: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        resolve(headers, None, None, None)
    assert bad.value.status == 400 and bad.value.param == named and named in bad.value.message


def test_llm_d_s_header_names_are_read_as_ours() -> None:
    """``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` (llm-d's router's names) mean what
    ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` do; a bad value's 400 names the header sent."""
    def objective(*headers: tuple[bytes, bytes]) -> Objective:
        return resolve(read_headers({"headers": list(headers)}).objective, None, None, None)

    ours = objective((b"x-slo-ttft-ms", b"250"), (b"x-slo-tpot-ms", b"20"))
    assert ours == Objective(0, 250.0, 20.0)
    assert objective((b"x-llm-d-slo-ttft-ms", b"250"), (b"x-llm-d-slo-tpot-ms", b"20")) == ours
    with pytest.raises(InvalidRequest) as bad:
        objective((b"x-llm-d-slo-tpot-ms", b"soon"))
    assert bad.value.param == "x-llm-d-slo-tpot-ms"


def test_a_named_objective_gives_the_defaults_before_the_keys_and_the_models() -> None:
    """``x-llm-d-inference-objective: NAME`` (an InferenceObjective): the config's entry of
    that name; headers still win, and a key's ceiling holds for the name too."""
    named = ObjectiveConfig(priority=2, ttft_ms=400)
    key, model = ObjectiveConfig(priority=1, tpot_ms=30), ObjectiveConfig(priority=0)
    assert resolve(NO_HEADERS, key, None, model, named) == Objective(2, 400.0, 30.0)
    assert resolve(ObjectiveHeaders(b"-1"), key, None, model, named).priority == -1
    with pytest.raises(PriorityNotAllowed) as refused:
        resolve(NO_HEADERS, key, 1, model, named)
    assert "names has 2" in refused.value.message
    assert resolve(NO_HEADERS, None, None, None, ObjectiveConfig(priority=-1)).sheddable


def test_llm_d_s_objective_and_fairness_headers_are_read() -> None:
    for name in (b"x-llm-d-inference-objective", b"x-gateway-inference-objective"):
        assert read_headers({"headers": [(name, b"chat")]}).objective_name == "chat"
    for name in (b"x-llm-d-inference-fairness-id", b"x-gateway-inference-fairness-id"):
        assert read_headers({"headers": [(name, b"tenant-a")]}).fairness == "tenant-a"
    too_long = read_headers({"headers": [(b"x-llm-d-inference-objective", b"x" * 300),
                                         (b"x-llm-d-inference-fairness-id", b"y" * 300)]})
    assert too_long.objective_name is None and too_long.fairness is None
