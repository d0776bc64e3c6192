"""The gateway in front of llama.cpp's own ``llama-server``, serving the tiny Llama as GGUF.

llama.cpp's wire differs from vLLM's in ways only the real server shows: it sends the end
of a generation in a chunk of its own, after the last token, and it merges tokens that end
inside a UTF-8 character into the chunk of the token that completes it (the random weights
make many such characters). TGI clients get exact streams and details from it all the same.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import orjson
import pytest
from text_generation import Client as TGIClient

from engines import Engine, llama_server
from gateway.tokens import ModelTokenizer
from shapes import SHAPE_REQUESTS, same_shapes, shape, uncovered
from scrape import by_label
from support import gateway_server, sim, wait_until
from tee import Cutter, Tee, tee

ADMIN = {"authorization": "Bearer real"}
SLOTS = 4
PROMPTS = ["The quick brown fox", "Hello world! Please write a short story about a cat.",
           "caf\u00e9 \u4f60\u597d \U0001f680 3.14 -42", "  spaces\tand\nnewlines  "]


@pytest.fixture(scope="module")
def engine(tiny_gguf: Path) -> Iterator[Engine]:
    with llama_server(tiny_gguf, "-np", str(SLOTS), "--metrics") as running:
        yield running


@pytest.fixture(scope="module")
def recorder(engine: Engine) -> Iterator[Tee]:
    with tee(engine.url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def gateway(recorder: Tee, tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "replicas": [
        {"url": recorder.url, "engine": "llamacpp", "name": "llamacpp-0"}]}],
              "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3}, "admin_token": "real"}
    with gateway_server(tmp_path_factory.mktemp("real-llamacpp"), config) as (url, _):
        yield url


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def test_token_ids_match_the_hugging_face_tokenizer(engine: Engine, tiny_model: Path) -> None:
    """The converted GGUF's tokenizer (llama.cpp's gpt-2 pre-tokenizer) is the model's."""
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    for text in PROMPTS:
        ids = _post(engine.url, "/tokenize", {"content": text}).json()["tokens"]
        assert ids == tokenizer.tokenizer.encode(text, add_special_tokens=False).ids, text


def _greedy(engine: Engine, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The engine's own greedy answer, with what it reports of each token."""
    return _post(engine.url, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 1}).json()


def test_openai_streams_pass_through_byte_for_byte(gateway: str, recorder: Tee) -> None:
    for body in ({"prompt": "The quick brown fox", "max_tokens": 16},
                 {"prompt": "Once upon", "max_tokens": 16,
                  "stream_options": {"include_usage": True}}):
        through = _post(gateway, "/v1/completions", {"model": "tiny", "temperature": 0,
                                                     "stream": True, **body})
        assert through.status_code == 200
        assert through.content == recorder.last("POST", "/v1/completions").body
    chat = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    chunks = list(chat.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_text_generation_stream_is_exact(gateway: str, engine: Engine, prompt: str) -> None:
    """One TGI event per generated token (tokens llama.cpp merged into a character's chunk
    included, as TGI sends them: empty text), ending in the final event; the text is the
    engine's greedy text, the count the engine's."""
    truth = _greedy(engine, prompt, 24)
    text = truth["choices"][0]["text"]
    reported = truth["choices"][0]["logprobs"]["content"]
    client = TGIClient(gateway, timeout=60)
    events = list(client.generate_stream(prompt, max_new_tokens=24))
    assert len(events) == 24 == truth["usage"]["completion_tokens"]
    assert [e.token.id for e in events if e.token.id != -1] == [t["id"] for t in reported]
    assert "".join(e.token.text for e in events) == text
    assert events[-1].generated_text == text
    assert events[-1].details.generated_tokens == 24
    assert events[-1].details.finish_reason.value == "length"


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_text_generation_details_are_exact(gateway: str, engine: Engine, prompt: str) -> None:
    truth = _greedy(engine, prompt, 24)
    reported = truth["choices"][0]["logprobs"]["content"]
    answer = TGIClient(gateway, timeout=60).generate(prompt, max_new_tokens=24, top_n_tokens=1)
    details = answer.details
    assert answer.generated_text == truth["choices"][0]["text"]
    assert details.generated_tokens == 24 == len(details.tokens)
    assert [t.id for t in details.tokens if t.id != -1] == [t["id"] for t in reported]
    assert [round(t.logprob, 4) for t in details.tokens if t.id != -1] == \
        [round(t["logprob"], 4) for t in reported]
    merged = [t for t in details.tokens if t.id == -1]
    assert all(t.text == "" and t.logprob is None for t in merged)
    assert "".join(t.text for t in details.tokens) == answer.generated_text
    assert len(details.top_tokens) == 24


def _stream_steps(engine: Engine, prompt: str, max_tokens: int) -> list[tuple[int, int]]:
    """The engine's own greedy stream, as TGI translation asks it (logprobs,
    ``timings_per_token``): per chunk, (logprobs entries, tokens generated so far)."""
    response = _post(engine.url, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 1, "stream": True, "timings_per_token": True})
    steps = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = orjson.loads(line[6:])
            logprobs = chunk["choices"][0].get("logprobs") if chunk.get("choices") else None
            steps.append((len((logprobs or {}).get("content") or []),
                          chunk["timings"]["predicted_n"]))
    return steps


# Prompts whose greedy outputs, on the tiny model (fixed-seed weights), have tokens ending
# inside a UTF-8 character: as the output's first token (the first three), and later (the
# others). Found by asking the engine; the test checks each case still happens.
BROKEN_PROMPTS = ["! the the x", "zz 42 caf\u00e9", "world \U0001f680 !",
                  "\u4f60\u597d 42 Once upon Once upon", "cat x", *PROMPTS[:2]]


def _cuts_inside_a_character(engine: Engine, prompt: str, longest: int) -> list[int]:
    """Output lengths whose last token ends inside a character: a chunk that reports one
    token but counts several carries, merged, the tokens before it that ended inside its
    character, so stopping at any of those ends the output inside it."""
    cuts, before = [], 0
    for reported, generated in _stream_steps(engine, prompt, longest):
        if reported and generated - before > reported:
            cuts.extend(range(before + 1, generated))
        before = generated
    return cuts


def test_tokens_ending_inside_a_character_are_events_at_start_middle_and_end(
        gateway: str, engine: Engine) -> None:
    """A generation cut inside a character: llama.cpp counts its last token only in the
    finishing chunk (no text, no logprobs). The TGI client still gets one event per token,
    the last with the engine's text, and details listing every token; ``generate`` alike."""
    cases = [(prompt, n) for prompt in BROKEN_PROMPTS
             for n in _cuts_inside_a_character(engine, prompt, 16)]
    assert any(n == 1 for _, n in cases), f"no output starts inside a character: {cases}"
    assert any(n > 2 for _, n in cases), f"no output ends inside a character later: {cases}"
    client = TGIClient(gateway, timeout=60)
    for prompt, n in cases[:12]:
        steps = _stream_steps(engine, prompt, n)
        # The case happens: the engine's last chunk counts a token it never reported.
        assert steps[-1][0] == 0 and steps[-1][1] == n > sum(r for r, _ in steps), (prompt, n, steps)
        truth = _greedy(engine, prompt, n)
        text = truth["choices"][0]["text"]
        events = list(client.generate_stream(prompt, max_new_tokens=n))
        reported = (truth["choices"][0]["logprobs"] or {}).get("content") or []  # none: null
        assert [e.token.id for e in events if e.token.id != -1] == [t["id"] for t in reported]
        assert len(events) == n == truth["usage"]["completion_tokens"], (prompt, n)
        # Its text is the engine's own whole answer's, the unfinished character shown as
        # U+FFFD (as TGI decodes it); the token events hold it back, as TGI's do.
        assert events[-1].generated_text == text == "".join(e.token.text for e in events) + "\ufffd"
        assert events[-1].details.generated_tokens == n
        answer = client.generate(prompt, max_new_tokens=n)
        assert answer.generated_text == text
        assert answer.details.generated_tokens == n == len(answer.details.tokens), (prompt, n)
        assert answer.details.tokens[-1].id == -1 and answer.details.tokens[-1].text == ""


def test_slots_are_the_replicas_concurrency_limit(gateway: str, engine: Engine) -> None:
    """/props total_slots: a fifth request waits in the gateway's queue, not in the engine."""
    replica = httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"][0]
    assert replica["max_concurrent_requests"] == SLOTS
    results: list[int] = []

    def one() -> None:
        results.append(_post(gateway, "/v1/completions", {
            "model": "tiny", "prompt": "slots", "max_tokens": 200, "ignore_eos": True}).status_code)

    threads = [threading.Thread(target=one) for _ in range(SLOTS + 3)]
    for t in threads:
        t.start()
    deferred = 0.0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        deferred = max(deferred, engine.metric("llamacpp:requests_deferred"))
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    assert results == [200] * (SLOTS + 3)
    assert deferred == 0


def test_window_is_discovered_and_enforced(gateway: str, engine: Engine) -> None:
    props = httpx.get(engine.url + "/props").json()
    per_slot = props["default_generation_settings"]["n_ctx"]
    replica = httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"][0]
    assert replica["max_model_len"] == per_slot
    refused = _post(gateway, "/v1/completions", {"model": "tiny", "prompt": "hello " * 400,
                                                 "max_tokens": 8})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def simulated_llamacpp(engine: Engine, tiny_model: Path) -> Iterator[str]:
    """The llama.cpp simulator with the same name, tokenizer and window (one slot's)."""
    per_slot = httpx.get(engine.url + "/props").json()["default_generation_settings"]["n_ctx"]
    with sim("llamacpp", "tiny", per_slot, "--tokenizer", str(tiny_model)) as url:
        yield url


# ... and what the gateway's TGI translation asks of llama.cpp: its count of tokens per chunk
LLAMACPP_SHAPE_REQUESTS = {**SHAPE_REQUESTS, "completion stream timings_per_token": (
    "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "stream": True,
                        "stream_options": {"include_usage": True}, "timings_per_token": True}),
    "chat stream timings_per_token": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "stream": True,
        "timings_per_token": True})}


@pytest.mark.parametrize("name", list(LLAMACPP_SHAPE_REQUESTS))
def test_the_simulator_answers_in_the_engines_shapes(engine: Engine, simulated_llamacpp: str,
                                                     name: str) -> None:
    assert same_shapes(engine.url, simulated_llamacpp, *LLAMACPP_SHAPE_REQUESTS[name]) == []


def test_the_simulator_describes_itself_as_the_engine_does(engine: Engine,
                                                           simulated_llamacpp: str) -> None:
    """/v1/models and /props, where the gateway learns the model, window and slots: all the
    simulator writes there, the engine writes alike (the engine writes much more)."""
    for path in ("/v1/models", "/props"):
        real, simulated = (shape(httpx.get(u + path).json()) for u in (engine.url, simulated_llamacpp))
        assert (path, uncovered(real, simulated)) == (path, [])


def test_a_broken_stream_is_not_continued_and_says_why(engine: Engine, tmp_path: Path) -> None:
    """llama.cpp's stream carries no token ids to continue from exactly (``/completion``'s
    ``tokens`` leave out those inside a character; see docs/migration.md), so a stream
    broken mid-answer ends as before migration, with the error event and ``[DONE]``, and
    is counted as not continued, reason ``engine``; the other replica then serves."""
    with tee(engine.url, Cutter) as cutter:
        assert isinstance(cutter, Cutter)
        cutter.marker = b"data: {"
        config = {"models": [{"name": "tiny", "replicas": [
            {"url": cutter.url, "engine": "llamacpp", "name": "cut"},
            {"url": engine.url, "engine": "llamacpp", "name": "whole"}]}],
            "balancer": "round_robin", "admin_token": "real",
            "outlier": {"consecutive_failures": 1000},
            "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3}}
        with gateway_server(tmp_path, config) as (gateway, _):
            body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 16,
                    "temperature": 0, "stream": True}
            for _ in range(2):  # round robin: one of the two starts on the cut replica
                cutter.cut_after = 4
                reply = _post(gateway, "/v1/completions", body)
                if reply.headers["x-gateway-replica"] == "cut":
                    break
            assert reply.status_code == 200 and cutter.cuts == 1
            events = [e for e in reply.content.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2], events[-2:]
            wait_until(lambda: by_label(gateway, "llm_gateway_streams_not_continued_total",
                                        "reason").get("engine") == 1, 10,
                       "the break counted as not continued")
            assert _post(gateway, "/v1/completions", body).status_code == 200
