"""Disaggregated serving without sockets: vLLM's prefill and decode bodies (its P/D proxy's
rules), the roles in the config, and placement by role: a prefill replica never answers, a
prefill goes to the decode replica's pool and reserves the prompt alone."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from gateway.balance.ledger import InProcessLedger
from gateway.balance.policy import make_policy
from gateway.config import ReplicaConfig, load_settings
from gateway.engines import get as engine
from gateway.fleet.model import Pool, ServedModel, build_models
from gateway.fleet.replica import Replica
from gateway.protocol.openai import parse_completion
from routing import Routing

VLLM = engine("vllm")


def test_a_prefill_body_asks_one_unstreamed_token_and_keeps_the_kv_for_a_remote_decode() -> None:
    body = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
                         "stream_options": {"include_usage": True}, "min_tokens": 5,
                         "temperature": 0})
    prefill = orjson.loads(VLLM.prefill_body(body))
    assert prefill == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                       "temperature": 0,
                       "kv_transfer_params": {"do_remote_decode": True,
                                              "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None}}
    chat = orjson.loads(VLLM.prefill_body(orjson.dumps({
        "model": "m", "messages": [], "max_completion_tokens": 9, "min_completion_tokens": 2})))
    assert chat["max_completion_tokens"] == 1 and "min_completion_tokens" not in chat
    # The prompt's own logits: only an engine that computes the prompt has them.
    assert VLLM.prefill_body(b'{"prompt": "hi", "prompt_logprobs": 0}') is None
    assert VLLM.prefill_body(b'{"prompt": "hi", "echo": true, "logprobs": 1}') is None


def test_the_handoff_is_the_prefills_kv_transfer_params_into_the_decode_body() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e",
              "remote_request_id": "r", "remote_host": "10.0.0.1", "remote_port": 5600}
    answer = orjson.dumps({"choices": [], "kv_transfer_params": params})
    handoff = VLLM.handoff(answer)
    assert handoff == params
    body = b'{"model":"m","prompt":"hi","max_tokens":50,"stream":true}'
    assert orjson.loads(VLLM.decode_body(body, handoff)) == {
        **orjson.loads(body), "kv_transfer_params": params}
    # A connector that needs nothing (ExampleConnector) answers null: the body goes as it is.
    assert VLLM.handoff(b'{"kv_transfer_params": null}') is None
    assert VLLM.decode_body(body, None) is body
    for broken in (b"not json", b"[1]", b'{"kv_transfer_params": [1]}'):
        with pytest.raises(ValueError):
            VLLM.handoff(broken)


def test_roles_in_the_config(tmp_path: Path) -> None:
    shorthand = ReplicaConfig(host="10.0.0.5", gpus=2, base_port=8000, role="decode")
    assert [r.role for r in shorthand.expand()] == ["decode", "decode"]
    with pytest.raises(ValueError, match="role"):
        ReplicaConfig(url="http://x:1", role="middle")  # type: ignore[arg-type]

    def models(replicas: list[dict]) -> None:
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump({"models": [{"name": "m", "replicas": replicas}]}))
        build_models(load_settings(path))

    models([{"url": "http://a:1", "role": "prefill"}, {"url": "http://b:1", "role": "decode"}])
    with pytest.raises(ValueError, match="cannot hand a prompt's KV cache"):
        models([{"url": "http://a:1", "engine": "tgi", "role": "prefill"}])


def _fleet() -> tuple[Routing, dict[str, Replica]]:
    def replica(name: str, pool: str, role: str) -> Replica:
        return Replica(name, f"http://{name}:1", "vllm", "m", pool, role=role)

    stable = [replica("p0", "stable", "prefill"), replica("p1", "stable", "prefill"),
              replica("d0", "stable", "decode")]
    canary = [replica("cp", "canary", "prefill"), replica("cd", "canary", "decode")]
    model = ServedModel("m", [Pool("stable", 50, stable), Pool("canary", 50, canary)], None,
                        4096, 16)
    routing = Routing({"m": model}, make_policy("least_outstanding_tokens"), InProcessLedger())
    return routing, {r.name: r for r in stable + canary}


async def test_a_prefill_replica_never_answers_and_a_prefill_stays_in_its_decodes_pool() -> None:
    routing, replicas = _fleet()
    request = parse_completion(b'{"model": "m", "prompt": "' + b"word " * 200 + b'", '
                               b'"max_tokens": 40}')
    model, admission = routing.admit(request)
    for _ in range(20):
        answer = await routing.place(model, admission)
        assert answer.replica.role == "decode"
        prefill = await routing.place(model, admission, prefill_for=answer.replica)
        assert prefill.replica.role == "prefill"
        assert prefill.replica.pool == answer.replica.pool
        # The prefill reserves the prompt and its one token; the decode the whole ask.
        load = routing.ledger.load(prefill.replica.name)
        assert load.prefill_tokens == admission.cost.prompt_tokens
        assert load.outstanding_tokens == admission.cost.prompt_tokens + 1
        prefill.lease.close()
        answer.lease.first_token()  # the prompt is prefilled: the decode holds the output
        assert routing.ledger.load(answer.replica.name).outstanding_tokens == 40
        answer.lease.close()
    assert all(routing.ledger.load(n).in_flight == 0 for n in replicas)
    # Least outstanding tokens among the prefill replicas: two prefills at once spread.
    model, admission = routing.admit(request)
    d0 = replicas["d0"]
    first = await routing.place(model, admission, prefill_for=d0)
    second = await routing.place(model, admission, prefill_for=d0)
    assert {first.replica.name, second.replica.name} == {"p0", "p1"}
