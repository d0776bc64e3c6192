"""The parsed request is the client's: no stage can write into it. What a stage decides is
its own result (the edge's Context, the Admission, the translation plan)."""

from __future__ import annotations

import orjson
import pytest

from gateway.balance.pool_split import PoolSplit
from gateway.dataplane.admission import Admitter
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.request import Caller, Context, GenerationRequest
from gateway.protocol.tgi import parse_generate
from gateway.protocol.translate import plan
from gateway.tokens import ModelTokenizer


def test_no_field_of_a_parsed_request_can_be_assigned() -> None:
    request = parse_generate(orjson.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 9}}),
                             False)
    for name in GenerationRequest._fields:
        with pytest.raises(AttributeError):
            setattr(request, name, getattr(request, name))
    # What stages used to write into it is not there to write either.
    for name in ("session", "pool", "caller", "pinned", "prompt_counts", "tgi_parameters"):
        with pytest.raises(AttributeError):
            setattr(request, name, None)
    assert request._replace(shadow=True).shadow and not request.shadow  # a copy is another


def test_admission_and_translation_leave_the_request_as_parsed(
        tokenizer: ModelTokenizer) -> None:
    """Through admission (a forced pool, a key, a capped output) and the translation the relay
    writes for a replica of the other dialect, the request stays as it was parsed; the cap is
    in the admission and in the engine's body."""
    replicas = [Replica(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm",
                        model="m", pool=pool, max_model_len=64)
                for i, pool in enumerate(["stable", "canary"])]
    model = ServedModel("m", [Pool("stable", 90, replicas[:1]), Pool("canary", 10, replicas[1:])],
                        tokenizer, None, 16)
    model.cap_output = True
    raw = orjson.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 500}})
    request = parse_generate(raw, True)
    before = request._asdict()
    context = Context(session="s1", pool="canary", caller=Caller("team-a"))
    _, admission = Admitter({"m": model}, "m", PoolSplit()).admit(request, context)
    assert [r.name for r in admission.replicas] == ["r1"]  # the pool the edge forced
    assert admission.cost.session == "s1"
    sent = orjson.loads(plan(request, "vllm", None, "m", None, 64, admission.output_cap,
                             admission.plan).body)
    assert request._asdict() == before and request.raw == raw
    assert request.body["parameters"]["max_new_tokens"] == 500
    assert admission.output_cap is not None and admission.output_cap < 64
    assert sent["max_tokens"] == admission.output_cap  # translated to /v1/completions
