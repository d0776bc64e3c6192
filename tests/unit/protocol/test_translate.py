"""The dialect translation tables and event mappings, as pure functions (no sockets)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest

from support import ROOT
from gateway import engines
from gateway.protocol.errors import Api, ApiNotServed, InvalidRequest, error_from_engine
from gateway.protocol.openai import parse_chat, parse_completion
from gateway.protocol.tgi import parse_generate
from gateway.protocol.translate import parse_version, plan, refusal, servable
from gateway.protocol.translate import openai_to_tgi
from gateway.protocol.translate.passthrough import PassThrough
from gateway.protocol.translate.tgi_request import (OPENAI_ENGINES, TGI_TO_OPENAI, CannotHonour,
                                                    openai_body, parse_parameters)
from gateway.protocol.translate.tgi_response import TgiStream, tgi_body

INPUTS = "Once upon a time"


def tgi(parameters: dict, path: str = "/generate") -> object:
    stream = {"/generate": False, "/generate_stream": True, "/": None}[path]
    return parse_generate(orjson.dumps({"inputs": INPUTS, "parameters": parameters}), stream)


# --- TGI parameters: TGI's own checks and words ---

@pytest.mark.parametrize("parameters, message", [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"truncate": 0}, "`truncate` must be strictly positive"),
    ({"grammar": {"type": "json", "value": {"type": "object"}}}, "Grammar must have a 'properties'"),
    ({"temperature": "hot"}, "`parameters.temperature` must be a number"),
])
def test_tgi_parameters_are_checked_as_tgi_does(parameters: dict, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_parameters({"inputs": INPUTS, "parameters": parameters}, stream=False, compat=False)
    assert message in err.value.message and err.value.status_for(Api.TGI) == 422


@pytest.mark.parametrize("parameters, message", [
    ({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming tokens"),
    ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported when "
                                      "streaming tokens")])
def test_stream_only_checks(parameters: dict, message: str) -> None:
    parse_parameters({"inputs": INPUTS, "parameters": parameters}, stream=False, compat=False)
    with pytest.raises(InvalidRequest, match=message):
        parse_parameters({"inputs": INPUTS, "parameters": parameters}, stream=True, compat=False)


def test_sampling_follows_tgis_server_rule() -> None:
    def sampling(parameters: dict) -> bool:
        return parse_parameters({"inputs": INPUTS, "parameters": parameters}, False, False).sampling
    assert not sampling({}) and not sampling({"seed": 3}) and not sampling({"temperature": 1.0})
    assert sampling({"do_sample": True}) and sampling({"temperature": 0.7})
    assert sampling({"top_k": 5}) and sampling({"top_p": 0.9}) and sampling({"typical_p": 0.9})


def test_compat_route_returns_full_text_by_default() -> None:
    body = {"inputs": INPUTS, "parameters": {}}
    assert parse_parameters(body, False, compat=True).return_full_text
    assert not parse_parameters(body, False, compat=False).return_full_text
    body["parameters"]["return_full_text"] = False
    assert not parse_parameters(body, False, compat=True).return_full_text


# --- the TGI -> OpenAI table: every engine without an equivalent refuses by name ---

REQUESTS = {"top_k": {"top_k": 5}, "typical_p": {"typical_p": 0.5},
            "repetition_penalty": {"repetition_penalty": 1.2}, "stop": {"stop": ["x"]},
            "best_of": {"best_of": 2, "do_sample": True}, "details": {"details": True},
            "decoder_input_details": {"decoder_input_details": True},
            "top_n_tokens": {"top_n_tokens": 2}, "adapter_id": {"adapter_id": "a"},
            "watermark": {"watermark": True},
            "grammar": {"grammar": {"type": "json", "value": {"properties": {}}}}}


@pytest.mark.parametrize("engine", OPENAI_ENGINES)
@pytest.mark.parametrize("name", list(REQUESTS))
def test_every_table_gap_is_a_422_naming_the_parameter(engine: str, name: str) -> None:
    request = tgi(REQUESTS[name])
    error = refusal(request, engine, None, has_tokenizer=True)
    if TGI_TO_OPENAI[name][engine] is None:
        assert isinstance(error, CannotHonour) and error.param == f"parameters.{name}"
        assert error.status_for(Api.TGI) == 422 and f"`{name}`" in error.message
        assert error.tgi_body()["error_type"] == "validation"
    else:
        assert error is None
        assert not isinstance(plan(request, engine, None, "m", None, 4096), PassThrough)  # it maps


def test_refusals_that_depend_on_more_than_the_engine() -> None:
    assert refusal(tgi({"top_n_tokens": 2}), "vllm", None, has_tokenizer=False) is not None
    assert refusal(tgi({"top_n_tokens": 2}), "vllm", None, has_tokenizer=True) is None
    assert refusal(tgi({"truncate": 3}), "sglang", None, has_tokenizer=False) is not None
    assert refusal(tgi({"truncate": 3}), "vllm", None, has_tokenizer=False) is None
    regex = {"grammar": {"type": "regex", "value": "a+"}}
    assert refusal(tgi(regex), "llamacpp", None, True) is not None
    assert refusal(tgi(regex), "vllm", None, True) is None
    assert refusal(tgi({}, "/generate_stream"), "openai", None, True).param == "stream"
    assert refusal(tgi({}), "openai", None, True) is None  # text only: no ids needed
    assert refusal(tgi({"watermark": True}), "tgi", None, True) is None  # native


@dataclass
class R:
    engine: str
    version: str | None = None


def test_servable_keeps_the_replicas_that_can_and_names_why_none_can() -> None:
    replicas = [R("vllm"), R("llamacpp"), R("tgi")]
    assert servable(tgi({"stop": ["x"]}), replicas, True) == [replicas[0], replicas[2]]
    assert servable(tgi({"watermark": True}), replicas, True) == [replicas[2]]
    with pytest.raises(CannotHonour, match="`watermark`"):
        servable(tgi({"watermark": True}), replicas[:2], True)


def body_for(parameters: dict, engine: str, stream: bool = False, **kwargs) -> tuple[dict, int | None]:
    p = parse_parameters({"inputs": INPUTS, "parameters": parameters}, stream, False)
    return openai_body(p, engines.get(engine), "m", stream, 10, None, seed_source=lambda: 99, **kwargs)


def test_request_mapping() -> None:
    body, seed = body_for({}, "vllm")
    assert body == {"model": "m", "prompt": INPUTS, "max_tokens": 10, "stream": False,
                    "temperature": 0.0} and seed is None  # greedy, TGI's default
    body, seed = body_for({"do_sample": True}, "vllm")
    assert body["temperature"] == 1.0 and body["seed"] == 99 and seed == 99  # TGI draws one
    body, seed = body_for({"temperature": 0.5, "seed": 7, "top_k": 3, "top_p": 0.9}, "llamacpp")
    assert (body["temperature"], body["seed"], body["top_k"], body["top_p"], seed) == (0.5, 7, 3, 0.9, 7)
    assert body_for({"repetition_penalty": 1.3}, "llamacpp")[0]["repeat_penalty"] == 1.3
    assert body_for({"repetition_penalty": 1.3}, "sglang")[0]["repetition_penalty"] == 1.3
    assert body_for({"stop": ["\n"]}, "vllm")[0]["include_stop_str_in_output"] is True
    assert body_for({"stop": ["\n"]}, "sglang")[0]["no_stop_trim"] is True
    assert body_for({"truncate": 5}, "vllm")[0]["truncate_prompt_tokens"] == 5
    best = body_for({"best_of": 3, "do_sample": True}, "vllm")
    assert best[0]["n"] == 3 and best[0]["logprobs"] == 0 and "seed" not in best[0]
    details = body_for({"details": True}, "vllm")[0]
    assert details["logprobs"] == 0 and details["return_token_ids"] is True
    assert body_for({}, "llamacpp", stream=True)[0]["logprobs"] == 1  # n_probs 0 gives nothing
    stream = body_for({}, "sglang", stream=True)[0]
    assert stream["stream_options"] == {"include_usage": True} and stream["return_token_ids"]
    top = body_for({"top_n_tokens": 4}, "vllm")[0]
    assert top["logprobs"] == 4 and top["return_tokens_as_token_ids"] is True
    assert body_for({"decoder_input_details": True}, "vllm")[0]["prompt_logprobs"] == 0
    schema = {"properties": {"a": {"type": "string"}}}
    grammar = {"grammar": {"type": "json", "value": schema}}
    assert body_for(grammar, "vllm")[0]["structured_outputs"] == {"json": schema}
    assert orjson.loads(body_for(grammar, "sglang")[0]["json_schema"]) == schema
    assert body_for(grammar, "llamacpp")[0]["json_schema"] == schema
    regex = {"grammar": {"type": "regex", "value": "[0-9]+"}}
    assert body_for(regex, "sglang")[0]["regex"] == "[0-9]+"
    assert body_for({"adapter_id": "lora-1"}, "vllm")[0]["model"] == "lora-1"
    assert body_for({"adapter_id": "lora-1"}, "sglang")[0]["lora_path"] == "lora-1"


def test_absent_max_new_tokens_fills_the_window_when_the_prompt_is_counted() -> None:
    from gateway.protocol.translate.tgi_request import max_tokens_for
    p = parse_parameters({"inputs": INPUTS, "parameters": {}}, False, False)
    assert max_tokens_for(p, 4096, 10) == 4086  # TGI >= 3.0
    assert max_tokens_for(p, 4096, None) == 100  # TGI < 3.0


# --- OpenAI engine output -> TGI events ---

def _vllm_chunk(text: str, token_id: int, logprob: float, finish: str | None = None,
                stop_reason: object = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": {"text_offset": [0], "token_logprobs": [logprob],
                                                     "tokens": [text], "top_logprobs": [{text: logprob}]},
              "finish_reason": finish, "stop_reason": stop_reason, "token_ids": [token_id]}
    return b"data: " + orjson.dumps({"id": "c", "object": "text_completion", "created": 1,
                                     "model": "m", "choices": [choice]}) + b"\n\n"


VLLM_STREAM = (_vllm_chunk(" The", 10, -0.5) + _vllm_chunk(" \"cat\"", 11, -0.25)
               + _vllm_chunk(" sat", 12, -1.0, "stop", " sat")
               + b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[],'
                 b'"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3}}\n\n'
               + b"data: [DONE]\n\n")


def translate_stream(data: bytes, cuts: list[int], parameters: dict, engine: str = "vllm",
                     max_tokens: int = 10) -> tuple[bytes, object]:
    p = parse_parameters({"inputs": INPUTS, "parameters": parameters}, True, False)
    reader = TgiStream(p, engines.get(engine), max_tokens, None, None)
    out, tokens = b"", 0
    for start, end in zip([0, *cuts], [*cuts, len(data)]):
        piece, n = reader.feed(data[start:end])
        out, tokens = out + piece, tokens + n
    out += reader.pending
    assert reader.finished and tokens == reader.token_events
    return out, reader


def test_tgi_events_from_a_vllm_stream_under_any_segmentation() -> None:
    whole, reader = translate_stream(VLLM_STREAM, [], {"details": True, "stop": [" sat"]})
    events = [orjson.loads(e[6:]) for e in whole.split(b"\n\n") if e]
    assert [e["index"] for e in events] == [1, 2, 3]
    assert events[1]["token"] == {"id": 11, "text": " \"cat\"", "logprob": -0.25, "special": False}
    assert events[-1]["generated_text"] == " The \"cat\" sat"
    assert events[-1]["details"] == {"finish_reason": "stop_sequence", "generated_tokens": 3,
                                     "seed": None, "input_length": 4}
    assert (reader.usage.prompt_tokens, reader.usage.completion_tokens, reader.token_events) == (4, 3, 3)
    for cut in range(1, len(VLLM_STREAM)):
        assert translate_stream(VLLM_STREAM, [cut], {"details": True, "stop": [" sat"]})[0] == whole


def test_final_event_waits_for_usage_only_when_details_need_it() -> None:
    p = parse_parameters({"inputs": INPUTS, "parameters": {}}, True, False)
    reader = TgiStream(p, engines.get("vllm"), 10, None, None)
    last = _vllm_chunk(" sat", 12, -1.0, "length")
    out, _ = reader.feed(_vllm_chunk(" The", 10, -0.5) + last)
    assert out.count(b'"generated_text":" The sat","details":null') == 1  # no wait
    p = parse_parameters({"inputs": INPUTS, "parameters": {"details": True}}, True, False)
    reader = TgiStream(p, engines.get("vllm"), 10, None, None)
    out, _ = reader.feed(_vllm_chunk(" The", 10, -0.5) + last)
    assert b"generated_text\":\" The sat" not in out and out.count(b"data: ") == 1


def test_llamacpp_stream_ends_in_a_chunk_of_its_own() -> None:
    def chunk(text: str, token_id: int, finish: str | None = None) -> bytes:
        content = [] if finish else [{"id": token_id, "token": text, "bytes": [], "logprob": -0.1,
                                      "top_logprobs": []}]
        return b"data: " + orjson.dumps({"choices": [{"text": text, "index": 0, "logprobs":
                                                      {"content": content} if content else None,
                                                      "finish_reason": finish}],
                                         "object": "text_completion"}) + b"\n\n"
    usage = b'data: {"choices":[],"usage":{"completion_tokens":3,"prompt_tokens":4,"total_tokens":7}}\n\n'
    eos = chunk(" a", 1) + chunk(" b", 2) + chunk("", 3) + chunk("", 0, "stop") + usage + b"data: [DONE]\n\n"
    out, _ = translate_stream(eos, [], {"details": True}, "llamacpp")
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert len(events) == 3 and events[-1]["token"]["special"] is True  # the empty EOS token
    assert events[-1]["details"]["finish_reason"] == "eos_token"
    length = chunk(" a", 1) + chunk(" b", 2) + chunk("", 0, "length") + usage + b"data: [DONE]\n\n"
    out, _ = translate_stream(length, [len(chunk(" a", 1))], {}, "llamacpp", max_tokens=2)
    assert out.count(b"data: ") == 2 and b'"generated_text":" a b"' in out
    # The engine ended after a token it did not mark as possibly last, and its count says
    # that was the last: an error, not a lie.
    counted_two = usage.replace(b'"completion_tokens":3', b'"completion_tokens":2')
    length = chunk(" a", 1) + chunk(" b", 2) + chunk("", 0, "length") + counted_two + b"data: [DONE]\n\n"
    out, _ = translate_stream(length, [], {}, "llamacpp", max_tokens=9)
    assert out.endswith(b'"error_type":"incomplete_generation"}\n\n')


def _llamacpp_counted(pieces: list[tuple[str, int | None]], finish: str, counted: int) -> bytes:
    """llama.cpp's completion stream as the real server writes it with ``timings_per_token``:
    each chunk's text with one logprobs entry (None: no entry), ``predicted_n`` the tokens
    generated so far; the finishing chunk has ``logprobs: null`` and may count a last token
    whose bytes never came (ENGINE-WIRE.md, "Real llama-server ... end of a stream")."""
    out, generated = [], 0
    for text, count in pieces:
        generated += count or 0
        entry = {"id": 70 + generated, "token": text, "bytes": list(text.encode()), "logprob": -0.5,
                 "top_logprobs": []}
        out.append(b"data: " + orjson.dumps({"choices": [{
            "text": text, "index": 0, "logprobs": {"content": [entry]}, "finish_reason": None}],
            "object": "text_completion", "timings": {"predicted_n": generated}}) + b"\n\n")
    out.append(b"data: " + orjson.dumps({"choices": [{
        "text": "", "index": 0, "logprobs": None, "finish_reason": finish}],
        "object": "text_completion", "usage": {"completion_tokens": counted, "prompt_tokens": 3,
                                               "total_tokens": counted + 3},
        "timings": {"predicted_n": counted}}) + b"\n\n")
    return b"".join(out) + b"data: [DONE]\n\n"


# (chunks as (text, tokens in it), tokens counted in all): the real engine's stream of six
# (four merged in the middle, the last token's bytes never sent), and the same case at the
# start of a stream (the first chunk merges three) and at its very first token.
COUNTED_STREAMS = {
    "middle and end": ([("j", 1), ("\ufffd\ufffdten", 4)], 6),
    "start and end": ([("\u00e9t", 3), ("e", 1)], 5),
    "only a broken character": ([], 1),
    "start only": ([("\u4f60", 2), (" a", 1)], 3),
}


@pytest.mark.parametrize("case", list(COUNTED_STREAMS))
def test_llamacpp_tokens_counted_but_never_sent_are_events_too(case: str) -> None:
    """Every generated token is an event, the last with ``generated_text`` and details that
    list them all: a token merged into a character's chunk, and a last one that ended inside
    a character and arrived as nothing but a count in the finishing chunk."""
    pieces, counted = COUNTED_STREAMS[case]
    data = _llamacpp_counted(pieces, "length", counted)
    whole, reader = translate_stream(data, [], {"details": True}, "llamacpp", max_tokens=counted)
    events = [orjson.loads(e[6:]) for e in whole.split(b"\n\n") if e]
    assert [e["index"] for e in events] == list(range(1, counted + 1))
    assert all("error" not in e for e in events)
    text = "".join(t for t, _ in pieces)
    assert "".join(e["token"]["text"] for e in events) == text
    # A last character never completed shows in the text as U+FFFD, as a whole decode has it.
    broken = sum(n for _, n in pieces) < counted
    assert events[-1]["generated_text"] == text + ("\ufffd" if broken else "")
    assert events[-1]["details"]["generated_tokens"] == counted
    assert reader.token_events == counted
    for cut in range(1, len(data), 7):
        assert translate_stream(data, [cut], {"details": True}, "llamacpp",
                                max_tokens=counted)[0] == whole


def test_a_count_without_timings_still_gives_every_token_its_event() -> None:
    """An engine that counts its tokens only in the usage: the ones never reported end the
    sequence (their character never completed), so the client still gets one per token."""
    data = _llamacpp_counted([("j", 1), ("\ufffdten", 2)], "length", 5)
    data = data.replace(b',"timings":{"predicted_n":1}', b"").replace(
        b',"timings":{"predicted_n":3}', b"").replace(b',"timings":{"predicted_n":5}', b"")
    assert b"timings" not in data
    out, _ = translate_stream(data, [], {"details": True}, "llamacpp", max_tokens=5)
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert len(events) == 5 and events[-1]["details"]["generated_tokens"] == 5
    assert [e["token"]["text"] for e in events] == ["j", "\ufffdten", "", "", ""]
    assert events[-1]["generated_text"] == "j\ufffdten\ufffd"


def test_engine_error_events_become_tgi_error_events() -> None:
    error = b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError"}}\n\n'
    out, reader = translate_stream(_vllm_chunk(" The", 10, -0.5) + error + b"data: [DONE]\n\n", [], {})
    assert out.endswith(b'data: {"error":"EngineCore died","error_type":"generation"}\n\n')
    assert reader.token_events == 1


def test_tgi_body_picks_the_best_of_and_lists_the_others() -> None:
    def choice(text: str, logprob: float) -> dict:
        return {"index": 0, "text": text, "finish_reason": "length", "stop_reason": None,
                "token_ids": [5], "logprobs": {"tokens": [text], "token_logprobs": [logprob],
                                               "top_logprobs": [{text: logprob}], "text_offset": [0]}}
    response = {"choices": [choice(" worse", -2.0), choice(" better", -0.1)],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    p = parse_parameters({"inputs": INPUTS, "parameters": {"best_of": 2, "do_sample": True,
                                                           "details": True}}, False, False)
    body, usage = tgi_body(p, engines.get("vllm"), response, None, None, compat=True)
    out = orjson.loads(body)
    assert isinstance(out, list) and out[0]["generated_text"] == " better"
    assert out[0]["details"]["best_of_sequences"][0]["generated_text"] == " worse"
    assert list(out[0]["details"]) == ["finish_reason", "generated_tokens", "seed", "prefill",
                                       "tokens", "best_of_sequences"]  # TGI's field order
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 2)


def test_engine_errors_take_tgis_statuses() -> None:
    translation = plan(tgi({}), "vllm", None, "m", None, 4096)
    for status, body, want in [
            (400, b'{"error":{"message":"bad","type":"BadRequestError"}}', 422),
            (404, b'{"error":{"message":"no adapter","type":"NotFoundError"}}', 422),
            (429, b'{"error":{"message":"busy","type":"x"}}', 429),
            (500, b'{"error":{"message":"died","type":"x"}}', 424),
            (400, b'{"error":{"message":"maximum context length is 9","type":"x"}}', 400)]:
        error = translation.engine_error(error_from_engine(status, body))
        assert error.status_for(Api.TGI) == want, (status, body)
        assert set(error.tgi_body()) == {"error", "error_type"}


# --- OpenAI completions -> TGI < 1.4.4 ---

def completion(body: dict) -> object:
    return parse_completion(orjson.dumps({"model": "m", "prompt": INPUTS, **body}))


@pytest.mark.parametrize("field, value", [("n", 2), ("presence_penalty", 0.5), ("suffix", "x"),
                                          ("logit_bias", {"1": 2}), ("min_tokens", 3)])
def test_completion_fields_tgi_cannot_honour_are_refused(field: str, value: object) -> None:
    error = refusal(completion({field: value}), "tgi", "1.4.3", False)
    assert isinstance(error, InvalidRequest) and error.param == field and error.status == 400


def test_completion_neutral_values_and_native_routes_pass() -> None:
    assert refusal(completion({"n": 1, "presence_penalty": 0}), "tgi", "1.4.3", False) is None
    assert refusal(completion({"n": 2}), "tgi", "1.4.4", False) is None  # TGI's own route
    assert refusal(completion({"n": 2}), "tgi", None, False) is None  # unknown: the newest
    chat = parse_chat(b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    assert isinstance(refusal(chat, "tgi", "1.3.4", False), ApiNotServed)
    assert isinstance(plan(chat, "tgi", "1.4.3", "m", None, None), PassThrough)  # Messages API
    assert parse_version("2.0.5-dev0") == (2, 0, 5) and parse_version("sha-abc") is None


def test_completion_request_mapping() -> None:
    body, _ = openai_to_tgi.tgi_body({"prompt": [INPUTS], "temperature": 0, "top_p": 1,
                                      "stop": "\n", "logprobs": 2}, stream=False)
    assert body == {"inputs": INPUTS, "stream": False, "parameters": {
        "details": True, "max_new_tokens": 16, "stop": ["\n"], "top_n_tokens": 2}}
    body, _ = openai_to_tgi.tgi_body({"prompt": INPUTS, "max_tokens": 5, "temperature": 0.5,
                                      "seed": 3, "best_of": 2}, stream=True)
    assert body["parameters"] == {"details": True, "max_new_tokens": 5, "do_sample": True,
                                  "temperature": 0.5, "seed": 3, "best_of": 2}


def test_completion_from_generate_cuts_the_stop_sequence() -> None:
    _, plan_ = openai_to_tgi.tgi_body({"prompt": INPUTS, "stop": [" sat"], "echo": True,
                                       "logprobs": 0}, stream=False)
    response = {"generated_text": " The cat sat", "details": {
        "finish_reason": "stop_sequence", "generated_tokens": 3, "prefill": [
            {"id": 1, "text": "Once", "logprob": None}],
        "tokens": [{"id": 5, "text": " The", "logprob": -0.5, "special": False},
                   {"id": 6, "text": " cat", "logprob": -0.4, "special": False},
                   {"id": 7, "text": " sat", "logprob": -0.3, "special": False}]}}
    body, usage = openai_to_tgi.completion_body(plan_, response, 4)
    out = orjson.loads(body)
    assert out["choices"][0]["text"] == INPUTS + " The cat"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5, -0.4, -0.3]
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def _tgi_event(index: int, text: str, final: str | None = None, special: bool = False,
               prefix: bytes = b"data:") -> bytes:
    details = None if final is None else {"finish_reason": "stop_sequence", "generated_tokens": index,
                                          "seed": None}
    return prefix + orjson.dumps({"index": index, "token": {"id": index, "text": text,
                                                            "logprob": -0.1, "special": special},
                                  "generated_text": final, "details": details}) + b"\n\n"


def test_completion_stream_holds_back_what_may_be_a_stop_sequence() -> None:
    _, plan_ = openai_to_tgi.tgi_body({"prompt": INPUTS, "stop": [" cat sat"], "stream": True,
                                       "stream_options": {"include_usage": True}}, stream=True)
    data = (b":\n\n" + _tgi_event(1, " The") + _tgi_event(2, " cat")
            + _tgi_event(3, " sat", final=" The cat sat"))
    for cut in [None, *range(1, len(data))]:
        reader = openai_to_tgi.CompletionStream(plan_, 4)
        out = b""
        for piece in ([data] if cut is None else [data[:cut], data[cut:]]):
            out += reader.feed(piece)[0]
        events = [e[6:] for e in out.split(b"\n\n") if e]
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert events[-1] == b"[DONE]" and reader.finished
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert texts == [" The", "", ""]  # " cat" might have started " cat sat": held, then cut
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        assert reader.token_events == 3


def test_completion_stream_error_event() -> None:
    _, plan_ = openai_to_tgi.tgi_body({"prompt": INPUTS, "stream": True}, stream=True)
    reader = openai_to_tgi.CompletionStream(plan_, None)
    out, tokens = reader.feed(_tgi_event(1, " The")
                              + b'data:{"error":"CUDA out of memory","error_type":"generation"}\n\n')
    assert tokens == 1 and reader.finished
    assert out.endswith(b'data: {"error":{"message":"CUDA out of memory","type":"upstream_error",'
                        b'"param":null,"code":null}}\n\ndata: [DONE]\n\n')


def _table_after(text: str, marker: str) -> dict[str, list[str]]:
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_documented_tables_are_the_code_tables() -> None:
    page = (ROOT / "docs" / "translation.md").read_text()
    shown = _table_after(page, "TGI -> OpenAI engine")
    assert shown == {name: ["—" if v is None else v for v in (fields[e] for e in OPENAI_ENGINES)]
                     for name, fields in TGI_TO_OPENAI.items()}
    shown = _table_after(page, "OpenAI completions -> TGI < 1.4.4")
    assert shown == {name: ["—" if v is None else v] for name, v in openai_to_tgi.OPENAI_TO_TGI.items()}


def test_an_answer_that_cannot_be_translated_is_an_upstream_error() -> None:
    from gateway.protocol.errors import UpstreamUnavailable
    translation = plan(tgi({}), "vllm", None, "m", None, 4096)
    with pytest.raises(UpstreamUnavailable, match="could not be translated"):
        translation.response(b'{"choices": []}', {})
    reader = translation.reader()
    with pytest.raises(UpstreamUnavailable, match="could not be translated"):
        reader.feed(b"data: {not json\n\n")
