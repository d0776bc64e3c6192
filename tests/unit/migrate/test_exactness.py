"""Which requests a broken stream may be continued for, and the reason named for the rest."""

from __future__ import annotations

import orjson
import pytest

from gateway import engines
from gateway.migrate.exactness import NotContinued, refusal
from gateway.protocol.openai import parse_chat, parse_completion
from gateway.protocol.tgi import parse_generate

VLLM = engines.get("vllm")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
COMPLETION = {"model": "m", "prompt": "hi", "stream": True}


@pytest.mark.parametrize("extra, why", [
    ({}, None),
    ({"temperature": 0.7, "top_p": 0.9, "seed": 1, "repetition_penalty": 1.1,
      "stop_token_ids": [2], "ignore_eos": True, "min_tokens": 3, "logit_bias": {"5": 1}}, None),
    ({"stop": ["\n"]}, NotContinued.STOP),
    ({"stop": []}, None),
    ({"n": 2}, NotContinued.CHOICES),
    ({"logprobs": 0}, NotContinued.LOGPROBS),
    ({"presence_penalty": 0.5}, NotContinued.PENALTIES),
    ({"frequency_penalty": 0.0}, None),
    ({"structured_outputs": {"regex": "a+"}}, NotContinued.STRUCTURED_OUTPUT),
    ({"response_format": {"type": "json_object"}}, NotContinued.STRUCTURED_OUTPUT),
    ({"suffix": "!"}, NotContinued.SUFFIX),
])
def test_completions(extra: dict, why: NotContinued | None) -> None:
    assert refusal(parse_completion(orjson.dumps({**COMPLETION, **extra})), VLLM) is why


@pytest.mark.parametrize("extra, why", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, NotContinued.LOGPROBS),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     NotContinued.TOOLS),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     NotContinued.STRUCTURED_OUTPUT),
])
def test_chat(extra: dict, why: NotContinued | None) -> None:
    assert refusal(parse_chat(orjson.dumps({**CHAT, **extra})), VLLM) is why


@pytest.mark.parametrize("parameters, why", [
    ({"max_new_tokens": 5, "details": True, "top_n_tokens": 2, "repetition_penalty": 1.2}, None),
    ({"stop": ["x"]}, NotContinued.STOP),
    ({"best_of": 2, "do_sample": True}, NotContinued.CHOICES),
    ({"grammar": {"type": "regex", "value": "a+"}}, NotContinued.STRUCTURED_OUTPUT),
    ({"frequency_penalty": 0.4}, NotContinued.PENALTIES),
    ({"watermark": True}, NotContinued.WATERMARK),
])
def test_tgi(parameters: dict, why: NotContinued | None) -> None:
    request = parse_generate(orjson.dumps({"inputs": "hi", "parameters": parameters}), True)
    assert refusal(request, VLLM) is why


@pytest.mark.parametrize("engine", sorted(set(engines.NAMES) - {"vllm"}))
def test_only_an_engine_that_continues_from_token_ids(engine: str) -> None:
    request = parse_completion(orjson.dumps(COMPLETION))
    assert refusal(request, engines.get(engine)) is NotContinued.ENGINE


def test_not_the_responses_api_nor_a_shadow_copy() -> None:
    from gateway.protocol.responses import parse_responses
    request = parse_responses(orjson.dumps({"model": "m", "input": "hi", "stream": True}))
    assert refusal(request, VLLM) is NotContinued.ROUTE
    shadow = parse_completion(orjson.dumps(COMPLETION))._replace(shadow=True)
    assert refusal(shadow, VLLM) is NotContinued.SHADOW
