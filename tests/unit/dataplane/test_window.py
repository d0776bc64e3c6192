"""The context-window check fires exactly at the boundary, per replica window."""

from __future__ import annotations

import pytest

from gateway.fleet.model import ServedModel, Pool
from gateway.fleet.replica import Replica
from gateway.protocol.errors import Api, ContextLengthExceeded
from gateway.protocol.openai import parse_chat, parse_completion
from gateway.protocol.tgi import parse_generate
from gateway.tokens import ModelTokenizer
from gateway.dataplane.admission import admit
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import plan

import orjson


def served(tokenizer: ModelTokenizer | None, windows: list[int | None]) -> ServedModel:
    replicas = [Replica(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm",
                        model="m", pool="default", max_model_len=w) for i, w in enumerate(windows)]
    return ServedModel("m", [Pool("default", 100, replicas)], tokenizer, None, 256)


def completion(prompt: str, max_tokens: int | None):
    body = {"model": "m", "prompt": prompt}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_completion(orjson.dumps(body))


def chat(text: str, max_tokens: int | None):
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_chat(orjson.dumps(body))


PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def test_completion_boundary_limit_passes_limit_plus_one_fails(tokenizer: ModelTokenizer) -> None:
    prompt_tokens = tokenizer.count_text(PROMPT, add_special_tokens=True)
    window = prompt_tokens + 50
    model = served(tokenizer, [window])
    ok = admit(model, completion(PROMPT, 50), model.replicas)
    assert ok.cost.prompt_tokens == prompt_tokens and ok.prompt_tokens_exact
    with pytest.raises(ContextLengthExceeded) as err:
        admit(model, completion(PROMPT, 51), model.replicas)
    assert (err.value.limit, err.value.prompt_tokens, err.value.max_tokens) == (window, prompt_tokens, 51)
    assert str(window) in err.value.message and str(prompt_tokens) in err.value.message


def test_chat_boundary_counts_the_rendered_template(tokenizer: ModelTokenizer) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    prompt_tokens = tokenizer.count_chat(messages)
    model = served(tokenizer, [prompt_tokens + 10])
    assert admit(model, chat(PROMPT, 10), model.replicas).cost.prompt_tokens == prompt_tokens
    with pytest.raises(ContextLengthExceeded):
        admit(model, chat(PROMPT, 11), model.replicas)


def test_without_max_tokens_prompt_must_be_shorter_than_window(tokenizer: ModelTokenizer) -> None:
    prompt_tokens = tokenizer.count_text(PROMPT)
    assert admit(served(tokenizer, [prompt_tokens + 1]), completion(PROMPT, None),
                 served(tokenizer, [prompt_tokens + 1]).replicas)
    model = served(tokenizer, [prompt_tokens])
    with pytest.raises(ContextLengthExceeded):
        admit(model, completion(PROMPT, None), model.replicas)


def test_long_request_goes_only_to_replicas_whose_window_fits(tokenizer: ModelTokenizer) -> None:
    prompt_tokens = tokenizer.count_text(PROMPT)
    model = served(tokenizer, [prompt_tokens, prompt_tokens * 4, None])
    fitting = admit(model, completion(PROMPT, 100), model.replicas).replicas
    assert [r.name for r in fitting] == ["r1", "r2"]


def test_short_prompt_skips_exact_count(tokenizer: ModelTokenizer) -> None:
    model = served(tokenizer, [8192])
    admission = admit(model, completion("hello", 16), model.replicas)
    assert not admission.prompt_tokens_exact and admission.cost.prompt_tokens >= 1


def test_tgi_overflow_uses_tgi_wording(tokenizer: ModelTokenizer) -> None:
    prompt_tokens = tokenizer.count_text(PROMPT)
    model = served(tokenizer, [prompt_tokens + 5])
    request = parse_generate(orjson.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}), False)
    with pytest.raises(ContextLengthExceeded) as err:
        admit(model, request, model.replicas)
    assert err.value.tgi_body() == {
        "error": f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
                 f"{prompt_tokens + 5}. Given: {prompt_tokens} `inputs` tokens and 6 `max_new_tokens`",
        "error_type": "validation"}
    assert err.value.status_for(Api.TGI) == 400


def test_without_tokenizer_only_certain_overflows_are_rejected() -> None:
    model = served(None, [1000])
    assert admit(model, completion(PROMPT * 100, 1000), model.replicas).replicas  # engine judges
    with pytest.raises(ContextLengthExceeded):
        admit(model, completion("hi", 1001), model.replicas)


def test_expected_output_without_max_tokens_is_the_documented_estimate(tokenizer) -> None:
    model = served(tokenizer, [8192])
    assert admit(model, completion("hi", None), model.replicas).cost.output_tokens == 256


def _engine_body(request: GenerationRequest, engine: str, cap: int | None) -> dict:
    """The body the relay sends a replica of ``engine`` (a TGI request on vLLM: translated)."""
    return orjson.loads(plan(request, engine, None, "m", None, None, cap).body)


def test_cap_serves_output_past_the_window_with_max_tokens_lowered(
        tokenizer: ModelTokenizer) -> None:
    """``output_past_window: cap``: the prompt fits, the output asked for does not: served by
    the replica with the most room, with max_tokens lowered to that room in the body the
    engine gets (OpenAI and TGI, passed through or translated), while the parsed request
    still says what the client asked; a prompt too long alone is still a 400."""
    prompt_tokens = tokenizer.count_text(PROMPT, add_special_tokens=True)
    model = served(tokenizer, [prompt_tokens + 20, prompt_tokens + 30])
    model.cap_output = True
    request = completion(PROMPT, 100)
    raw, body = request.raw, orjson.loads(request.raw)
    admitted = admit(model, request, model.replicas)
    assert [r.name for r in admitted.replicas] == ["r1"]
    assert admitted.output_cap == 30 and admitted.cost.output_tokens == 30
    assert _engine_body(request, "vllm", admitted.output_cap) == {**body, "max_tokens": 30}
    assert request.max_tokens == 100 and request.raw == raw and request.body == body
    chat_request = parse_chat(orjson.dumps({"model": "m", "max_completion_tokens": 500,
                                            "messages": [{"role": "user", "content": PROMPT}]}))
    cap = admit(model, chat_request, model.replicas).output_cap
    sent = _engine_body(chat_request, "vllm", cap)
    assert "max_tokens" not in sent and sent["max_completion_tokens"] == cap < 500
    assert chat_request.max_tokens == 500
    tgi = parse_generate(orjson.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 99}}),
                         False)
    cap = admit(model, tgi, model.replicas).output_cap
    assert cap is not None and cap < 99
    assert _engine_body(tgi, "tgi", cap)["parameters"]["max_new_tokens"] == cap
    assert _engine_body(tgi, "vllm", cap)["max_tokens"] == cap  # translated to /v1/completions
    assert tgi.max_tokens == 99 and tgi.body["parameters"]["max_new_tokens"] == 99
    assert _engine_body(tgi, "tgi", None)["parameters"]["max_new_tokens"] == 99  # uncapped
    with pytest.raises(ContextLengthExceeded):  # the prompt alone does not fit
        admit(served(tokenizer, [prompt_tokens]), completion(PROMPT, 5),
              served(tokenizer, [prompt_tokens]).replicas)
    model.cap_output = False  # the default: OpenAI's 400
    with pytest.raises(ContextLengthExceeded):
        admit(model, completion(PROMPT, 100), model.replicas)


async def test_a_long_prompt_is_counted_off_the_event_loop_and_exactly(
        tokenizer: ModelTokenizer) -> None:
    """A prompt of a request body past COUNT_OFF_LOOP_BYTES is tokenized in a worker thread
    (about 1 µs a character: on the event loop, no stream would move meanwhile); admission
    then uses that count, the same as counting it in place."""
    import threading

    from gateway.balance.pool_split import PoolSplit
    from gateway.dataplane.admission import COUNT_OFF_LOOP_BYTES, Admitter

    threads: list[threading.Thread] = []
    counting = tokenizer.count_text

    def count_text(text: str, add_special_tokens: bool = True) -> int:
        threads.append(threading.current_thread())
        return counting(text, add_special_tokens)

    long = PROMPT * (COUNT_OFF_LOOP_BYTES // len(PROMPT) + 1)
    exact = counting(long)
    model = served(tokenizer, [exact + 10, exact * 2])
    admitter = Admitter({"m": model}, "m", PoolSplit())
    tokenizer.count_text = count_text  # type: ignore[method-assign]
    try:
        short = completion(PROMPT, 10)
        assert admitter.prepare(short) is None  # nothing to wait for: counted in place
        request = completion(long, 11)
        prepared = await admitter.prepare(request)
        assert threads and threading.main_thread() not in threads
        assert prepared.prompt_counts == [exact]
        threads.clear()
        _, admission = admitter.admit(request, prepared=prepared)
        assert not threads  # not counted again
        assert admission.cost.prompt_tokens == exact and admission.prompt_tokens_exact
        assert [r.name for r in admission.replicas] == ["r1"]  # 11 more do not fit r0
        refused = completion(long, exact + 1)
        prepared = await admitter.prepare(refused)
        with pytest.raises(ContextLengthExceeded) as err:
            admitter.admit(refused, prepared=prepared)
        assert err.value.prompt_tokens == exact and err.value.limit == exact * 2
        # A long chat: rendered and counted in the thread too.
        messages = chat(long, 5)
        prepared = await admitter.prepare(messages)
        assert prepared.prompt_counts == [tokenizer.count_chat([{"role": "user", "content": long}])]
        # Long, but the one-token-per-byte bound fits every window: nothing to count.
        roomy = served(tokenizer, [len(long) * 4])
        fits = completion(long, 16)
        prepared = await Admitter({"m": roomy}, "m", PoolSplit()).prepare(fits)
        assert prepared.prompt_counts is None
    finally:
        del tokenizer.count_text


def test_counting_gives_encodes_count_for_any_text(tokenizer: ModelTokenizer) -> None:
    """count_text uses encode_batch_fast (it lets go of the GIL); encode is the reference."""
    import random

    rng = random.Random(7)
    alphabet = "abc déf ghï 日本語 😀 \n\t  the quick brown fox <|im_start|> \u200b"
    for n in [0, 1, 3, 50, 500, 5000] * 20:
        text = "".join(rng.choice(alphabet) for _ in range(n))
        for special in (True, False):
            want = len(tokenizer.tokenizer.encode(text, add_special_tokens=special).ids)
            assert tokenizer.count_text(text, special) == want, (text, special)
