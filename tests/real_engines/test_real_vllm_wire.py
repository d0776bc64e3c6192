"""Every wire contract the gateway keeps with vLLM, checked against a real vLLM (CPU build).

One fp32 engine serves the tiny random-weight Llama; the gateway stands in front of it with
the model's tokenizer and discovers the window (1024) from the engine. Between the two sits a
recording proxy (``tee``), so each answer the client gets is compared byte for byte with what
the engine sent for that very request; and with what a client asking the engine directly
gets (the same events, whatever way vLLM groups tokens into chunks under load).

The engine exports its own OTLP traces (``--otlp-traces-endpoint``) to a loopback receiver,
as the gateway in front of it does: its span must sit under the gateway's attempt span.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import orjson
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client as TGIClient

from engines import Engine, VllmSpec, vllms
from gateway.engines.vllm import parse_lora_info
from otlp_receiver import OtlpReceiver, Span, children
from recorded_streams import as_the_client_asked, without_token_ids
from gateway.tokens import ModelTokenizer
from shapes import SHAPE_REQUESTS, differences, metric_families, same_shapes, shape
from support import gateway_server, settle, sim, wait_until
from tee import Tee, tee
from tiny_model import write_lora

ADMIN = {"authorization": "Bearer real"}
# Spans leave a batch processor this often (the OpenTelemetry SDK's variable).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random rank-8 LoRA adapters of the tiny Llama: `sql` served from the start, `fin`
    loaded at run time through the gateway."""
    root = tmp_path_factory.mktemp("lora")
    return {name: write_lora(root / name, str(tiny_model), seed=seed)
            for name, seed in (("sql", 1), ("fin", 2))}


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    """Where the engine and the traced gateway send their spans (started before the engine:
    vLLM's exporter is set up when it starts)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def engines(tiny_model: Path, adapters: dict[str, Path], otlp: OtlpReceiver
            ) -> Iterator[list[Engine]]:
    """The generate engine and, started beside it (their starts overlap), the same weights
    as an embedding engine (`--runner pooling`) for the routes that generate nothing."""
    # One engine serves several names (an alias, a LoRA adapter) and stores Responses: the
    # many-names checks share this engine rather than start another (about 40 s each).
    # vLLM exports over gRPC unless told otherwise; the receiver speaks OTLP/HTTP.
    generate = VllmSpec(
        ("--otlp-traces-endpoint", otlp.url, "--enable-lora",
         "--lora-modules", f"sql={adapters['sql']}", "--max-lora-rank", "8"),
        names=("tiny", "tiny-alias"),
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **FAST_EXPORT,
             "OTEL_SERVICE_NAME": "vllm-engine", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
             "VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    pooling = VllmSpec(("--runner", "pooling"), names=("tiny-embed",))
    with vllms(tiny_model, generate, pooling) as running:
        yield running


@pytest.fixture(scope="module")
def engine(engines: list[Engine]) -> Engine:
    return engines[0]


@pytest.fixture(scope="module")
def pooling_engine(engines: list[Engine]) -> Engine:
    return engines[1]


@pytest.fixture(scope="module")
def recorder(engine: Engine) -> Iterator[Tee]:
    with tee(engine.url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def gateway(recorder: Tee, tiny_model: Path, adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model),
                          "load_adapters": {"fin": str(adapters["fin"])}, "replicas": [
        {"url": recorder.url, "engine": "vllm", "name": "vllm-0"}]}],
              "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3}, "admin_token": "real",
              "scheduling": {"signals_interval": 0.2}}
    with gateway_server(tmp_path_factory.mktemp("real-vllm"), config) as (url, _):
        yield url


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


BODIES = {
    "completion": ("/v1/completions", {"model": "tiny", "prompt": "The quick brown fox",
                                       "max_tokens": 24, "temperature": 0}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 24, "temperature": 0,
                                      "messages": [{"role": "user", "content": "Hello there"}]}),
}


def _events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


def semantic(data: bytes, stream: bool) -> dict[str, Any]:
    """What a client reads, whatever the chunking: the text per choice, the first and the
    terminal chunk, the usage (ids and creation times aside)."""
    if not stream:
        body = orjson.loads(data)
        body.pop("id"), body.pop("created")
        return body
    chunks = [orjson.loads(e[6:]) for e in _events(data) if e != b"data: [DONE]"]
    texts: dict[int, str] = {}
    for chunk in chunks:
        chunk.pop("id"), chunk.pop("created")
        for choice in chunk["choices"]:
            piece = choice.get("text") if "text" in choice else choice["delta"].get("content")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    terminal = [c for c in chunks if any(ch.get("finish_reason") for ch in c["choices"])]
    for chunk in terminal:
        for choice in chunk["choices"]:
            choice.pop("text", None), choice.get("delta", {}).pop("content", None)
    return {"texts": texts, "first": chunks[0] if "delta" in str(chunks[0]) else None,
            "terminal": terminal, "usage": [c["usage"] for c in chunks if c.get("usage")],
            "done": data.endswith(b"data: [DONE]\n\n")}


@pytest.mark.parametrize("kind", list(BODIES))
@pytest.mark.parametrize("shape", ["whole", "stream", "stream+usage"])
def test_answers_are_the_engines_byte_for_byte(engine: Engine, recorder: Tee, gateway: str,
                                               kind: str, shape: str) -> None:
    path, body = BODIES[kind]
    body = dict(body)
    if shape != "whole":
        body["stream"] = True
    if shape == "stream+usage":
        body["stream_options"] = {"include_usage": True}
    through = _post(gateway, path, body)
    assert through.status_code == 200, through.text
    sent = recorder.last("POST", path)
    assert sent.status == 200
    if shape == "whole":
        assert through.content == sent.body
    else:
        # The gateway asked for the token ids (migration): the client did not.
        assert b'"token_ids":[' in sent.body
        assert through.content == as_the_client_asked(without_token_ids(sent.body),
                                                      shape == "stream+usage")
        assert through.content.endswith(b"data: [DONE]\n\n")
    assert through.headers["content-type"] == sent.headers["content-type"]
    # And what a client asking the engine directly reads: the same (greedy); a whole answer
    # byte for byte but for its id and time (a stream's chunks merge tokens as the engine
    # falls behind, differently each time).
    direct = _post(engine.url, path, body)
    assert semantic(through.content, shape != "whole") == semantic(direct.content, shape != "whole")
    if shape == "whole":
        assert _unstamped(through.content) == _unstamped(direct.content)


def _unstamped(data: bytes) -> bytes:
    return re.sub(rb'"created":[0-9]+', b'"created":0',
                  re.sub(rb'"id":"[^"]*"', b'"id":""', data))


def test_many_streams_all_end_whole(gateway: str) -> None:
    """Concurrent streams (the engine batches them): each ends with its usage and [DONE]."""
    results: list[bytes] = []

    def one(i: int) -> None:
        with httpx.stream("POST", gateway + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"story {i}", "max_tokens": 32, "stream": True,
                "ignore_eos": True,  # sampled: an early EOS would end it short, and whole
                "stream_options": {"include_usage": True}}) as response:
            results.append(response.read())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 32
    for data in results:
        assert data.endswith(b"data: [DONE]\n\n")
        assert b'"completion_tokens":32' in data


def test_openai_client(gateway: str, engine: Engine) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = dict(model="tiny", prompt="Once upon a time", max_tokens=16,
                                  temperature=0)
    assert client.completions.create(**kwargs).choices[0].text == \
        direct.completions.create(**kwargs).choices[0].text
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    # The model first, then the names its engine also serves (an alias, LoRA adapters).
    names = [m.id for m in client.models.list().data]
    assert names[0] == "tiny" and {"tiny-alias", "sql"} <= set(names)


def _engine_greedy(engine: Engine, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The engine's own greedy answer with its token ids and logprobs."""
    answer = _post(engine.url, "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 0, "return_token_ids": True}).json()
    return answer["choices"][0]


def test_text_generation_client_through_translation(gateway: str, engine: Engine) -> None:
    """A TGI client on vLLM: the text, token ids and details are the engine's greedy ones."""
    prompt = "The gateway routes each request"
    truth = _engine_greedy(engine, prompt, 12)
    client = TGIClient(gateway, timeout=60)
    answer = client.generate(prompt, max_new_tokens=12, decoder_input_details=True,
                             top_n_tokens=2)
    assert answer.generated_text == truth["text"]
    details = answer.details
    assert details.generated_tokens == 12 and details.finish_reason.value == "length"
    assert [t.id for t in details.tokens] == truth["token_ids"]
    assert "".join(t.text for t in details.tokens) == truth["text"]
    assert [round(t.logprob, 4) for t in details.tokens] == \
        [round(v, 4) for v in truth["logprobs"]["token_logprobs"]]
    assert details.prefill and details.prefill[0].logprob is None
    assert all(len(top) == 2 for top in details.top_tokens)
    events = list(client.generate_stream(prompt, max_new_tokens=12))
    assert [e.token.id for e in events] == truth["token_ids"]
    assert "".join(e.token.text for e in events) == truth["text"]
    assert events[-1].generated_text == truth["text"]
    assert events[-1].details.generated_tokens == 12


def test_huggingface_hub_client(gateway: str, engine: Engine) -> None:
    prompt = "Please write a short story"
    truth = _engine_greedy(engine, prompt, 10)
    client = InferenceClient(gateway, timeout=60)
    # POST / (TGI's compat route, which this client uses) puts the prompt first, as TGI does.
    assert client.text_generation(prompt, max_new_tokens=10) == prompt + truth["text"]
    streamed = "".join(client.text_generation(prompt, max_new_tokens=10, stream=True))
    assert streamed == truth["text"]


def _engine_count(engine: Engine, text: str) -> int:
    answer = _post(engine.url, "/tokenize", {"model": "tiny", "prompt": text})
    return answer.json()["count"]


def test_window_discovered_and_400_counts_as_the_engine(gateway: str, engine: Engine,
                                                       tiny_model: Path) -> None:
    replicas = httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"]
    assert replicas[0]["max_model_len"] == 1024
    prompt = "the quick brown fox jumps over the lazy dog " * 105
    prompt_tokens = _engine_count(engine, prompt)
    assert prompt_tokens == ModelTokenizer.from_dir(tiny_model).count_text(prompt)
    assert prompt_tokens + 100 > 1024 >= prompt_tokens
    before = engine.metric("vllm:request_success_total")
    refused = _post(gateway, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 100})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"{prompt_tokens}" in error["message"] and "1024" in error["message"]
    assert engine.metric("vllm:request_success_total") == before  # never reached the engine
    # The engine itself answers 200 and cuts max_tokens; the gateway keeps OpenAI's 400.
    direct = _post(engine.url, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                   "max_tokens": 100})
    assert direct.status_code == 200
    assert direct.json()["usage"]["completion_tokens"] == 1024 - prompt_tokens


def test_too_long_prompt_matches_the_engines_own_count(gateway: str, engine: Engine) -> None:
    """A prompt past the window alone: refused by both, the gateway counting what the
    engine's tokenizer counts (vLLM's own message stops counting at the window + 1)."""
    prompt = "the quick brown fox jumps over the lazy dog " * 120
    direct = _post(engine.url, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                   "max_tokens": 1})
    assert direct.status_code == 400
    error = direct.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
    assert "value=1025" in error["message"]
    count = _engine_count(engine, prompt)
    through = _post(gateway, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 1})
    assert through.status_code == 400
    assert f"({count} in the prompt, 1 in the completion)" in through.json()["error"]["message"]


def test_engine_signals_read_from_the_real_metrics(gateway: str) -> None:
    """Under load, the gateway's view of the replica carries the engine's own running count
    and KV use, read from vLLM's /metrics."""
    stop = threading.Event()
    statuses: list[int | str] = []  # what the load got, to say why if the engine never ran

    def load() -> None:
        while not stop.is_set():
            try:
                statuses.append(_post(gateway, "/v1/completions", {
                    "model": "tiny", "prompt": "load", "max_tokens": 128}).status_code)
            except httpx.HTTPError as exc:
                statuses.append(repr(exc))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        def signals() -> dict[str, Any]:
            replica = httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"][0]
            return replica.get("engine_signals") or {}

        seen = settle(signals, lambda s: (s.get("running") or 0) > 0
                      and (s.get("kv_usage") or 0) > 0, 30, every=0.1)
        assert (seen.get("running") or 0) > 0 and 0 < seen["kv_usage"] <= 1, \
            (seen, sorted(Counter(map(str, statuses)).items()))
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def _generated_after_leaving(gateway: str, engine: Engine) -> float:
    """Tokens the engine generated for a 1,000-token stream whose client left at its first
    token: read from the engine's token counter once it has not moved for a second (not
    from its running gauge, which follows the engine core's stats and lags under load)."""
    generated = lambda: engine.metric("vllm:generation_tokens_total")  # noqa: E731
    before = generated()
    with httpx.stream("POST", gateway + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "a long one", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}) as response:
        assert next(response.iter_lines()).startswith("data: ")
    last, still_since = -1.0, time.monotonic()

    def still_for_a_second() -> bool:
        nonlocal last, still_since
        if time.monotonic() - still_since >= 1.0:
            return True
        now = generated()
        if now != last:
            last, still_since = now, time.monotonic()
        return False

    wait_until(still_for_a_second, 20, "the engine's token counter to settle")
    return last - before


def test_client_disconnect_frees_the_engine(gateway: str, engine: Engine) -> None:
    """A client that leaves after its first token: the engine stops generating for it (vLLM
    aborts the request) instead of writing all 1,000 tokens. The tiny model writes 1,000 in
    about 2.5 s, and on a CPU-starved machine vLLM's API server can hand out the first token
    only after its engine core wrote them all (seen straight to the engine too, no gateway
    between), so a try can prove nothing: up to five tries, one must stop early. Without the
    gateway's cancel on disconnect every try writes all 1,000."""
    tries = []
    while len(tries) < 5 and (not tries or tries[-1] >= 500):
        tries.append(_generated_after_leaving(gateway, engine))
    assert 1 <= tries[-1] < 500, tries
    assert engine.metric("vllm:num_requests_running") == 0


def test_output_past_window_cap_serves_as_the_engine_does(engine: Engine, tiny_model: Path,
                                                          tmp_path: Path) -> None:
    """``output_past_window: cap``: the gateway serves what vLLM itself would (200, max_tokens
    cut to the room the prompt leaves) instead of OpenAI's 400."""
    config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model),
                          "output_past_window": "cap",
                          "replicas": [{"url": engine.url, "engine": "vllm"}]}]}
    prompt = "the quick brown fox jumps over the lazy dog " * 105
    room = 1024 - _engine_count(engine, prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": room + 50, "temperature": 0}
    with gateway_server(tmp_path, config) as (url, _):
        through = _post(url, "/v1/completions", body)
    direct = _post(engine.url, "/v1/completions", body)
    assert through.status_code == direct.status_code == 200, through.text
    assert through.json()["usage"] == direct.json()["usage"]
    assert through.json()["usage"]["completion_tokens"] == room
    assert through.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]


@pytest.mark.parametrize("api", ["openai", "tgi"])
def test_bench_through_the_gateway_and_straight_to_the_engine(
        gateway: str, engine: Engine, api: str, tmp_path: Path) -> None:
    """`llm-gateway bench` on the real engine, through the gateway and directly: every request
    served, output counted from the engine's own usage on both (the TGI run through the
    gateway's translation; straight to vLLM only OpenAI is spoken). The tokens/s share is
    measured this way (docs/performance.md), never asserted here."""
    import json
    import subprocess
    import sys

    from support import ROOT

    def bench(url: str, api_: str, out: Path) -> dict[str, Any]:
        subprocess.run([sys.executable, "-m", "gateway", "bench", url, "--api", api_, "--stream",
                        "--model", "tiny", "--concurrency", "8", "--requests", "48",
                        "--output-tokens", "32", "--prompt-tokens", "16", "--json", str(out),
                        "--no-progress"], cwd=ROOT, check=True, capture_output=True, timeout=600)
        return json.loads(out.read_text())["levels"][0]["overall"]

    generated_before = engine.metric("vllm:generation_tokens_total")
    through = bench(gateway, api, tmp_path / "gateway.json")
    generated_through = engine.metric("vllm:generation_tokens_total") - generated_before
    direct = bench(engine.url, "openai", tmp_path / "direct.json")
    generated_direct = (engine.metric("vllm:generation_tokens_total") - generated_before
                        - generated_through)
    for run, generated in ((through, generated_through), (direct, generated_direct)):
        assert run["ok"] == run["requests"] == 48 and not run["errors"], run
        # Counted from the engine's own usage (some answers end early on the random
        # weights' end-of-sequence token): what the engine says it generated.
        assert run["output_tokens"] == generated > 0
        assert run["output_tokens_per_s"] > 0


# The shape checks' requests, and one only vLLM takes (token ids in the stream)
VLLM_SHAPE_REQUESTS = {**SHAPE_REQUESTS, "completion stream logprobs+token ids": (
    "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "stream": True,
                        "logprobs": 2, "return_token_ids": True}),
    "completion stream, 4 tokens a chunk": ("/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": 10, "stream": True, "logprobs": 1,
        "return_token_ids": True, "stream_interval": 4, "ignore_eos": True}),
    # 903 prompt tokens: 0.32 answers 200 with max_tokens cut to the 121 left
    "output past the window": ("/v1/completions", {"prompt": "word " * 450, "max_tokens": 200}),
    "nothing left for output": ("/v1/completions", {"prompt": [5] * 1024, "max_tokens": 10})}


@pytest.fixture(scope="module")
def simulated_vllm(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[str]:
    """The vLLM simulator serving the same names (the alias, the adapter), window and
    tokenizer as the real engine."""
    with sim("vllm", "tiny", 1024, "--tokenizer", str(tiny_model), "--alias", "tiny-alias",
             "--lora-modules", f"sql={adapters['sql']}") as url:
        yield url


@pytest.mark.parametrize("name", list(VLLM_SHAPE_REQUESTS))
def test_the_simulator_answers_in_the_engines_shapes(engine: Engine, simulated_vllm: str,
                                                     name: str) -> None:
    assert same_shapes(engine.url, simulated_vllm, *VLLM_SHAPE_REQUESTS[name]) == []


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "The quick brown fox", "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}),
])
def test_the_simulator_groups_tokens_in_chunks_as_the_engine_does(
        engine: Engine, simulated_vllm: str, path: str, body: dict[str, Any]) -> None:
    """`stream_interval` 4: the first token in a chunk of its own, then four to a chunk, the
    rest with the last; each chunk's logprobs cover its tokens. The engine merges chunks its
    API server had not sent yet when the next came (a loaded machine: CI once saw [1, 4, 5]),
    so each of its answers must be the simulator's chunks, some merged, and one of a few
    answers exactly them."""
    body = {**body, "model": "tiny", "max_tokens": 10, "stream": True, "stream_interval": 4,
            "ignore_eos": True}

    def sizes(url: str) -> list[int]:
        chunks = [orjson.loads(e[6:]) for e in _events(_post(url, path, body).content)
                  if e.startswith(b"data: {")]
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        return [len(lp["content"] if "content" in lp else lp["tokens"])
                for lp in logprobs if lp]

    assert sizes(simulated_vllm) == [1, 4, 4, 1]
    seen = []
    for _ in range(5):
        seen.append(sizes(engine.url))
        assert _boundaries(seen[-1]) <= _boundaries([1, 4, 4, 1]), seen
        assert sum(seen[-1]) == 10, seen
        if seen[-1] == [1, 4, 4, 1]:
            break
    assert seen[-1] == [1, 4, 4, 1], seen


def _boundaries(sizes: list[int]) -> set[int]:
    """Where each chunk ends, counted in tokens: merged chunks lose a boundary, never gain one."""
    return {sum(sizes[:i + 1]) for i in range(len(sizes))}


def test_the_simulator_lists_its_model_and_metrics_as_the_engine_does(
        engine: Engine, simulated_vllm: str) -> None:
    """Its /v1/models in the engine's shape; each vllm: family it exposes, the engine exposes
    with the same type and at least its labels; and both expose what the gateway reads."""
    real, simulated = (shape(httpx.get(u + "/v1/models").json()) for u in (engine.url, simulated_vllm))
    assert differences(real, simulated) == []
    real_families, sim_families = metric_families(engine.url), metric_families(simulated_vllm)
    wrong = {name: (real_families.get(name), kind) for name, (kind, labels) in sim_families.items()
             if name.startswith("vllm:") and not (
                 name in real_families and real_families[name][0] == kind
                 and labels <= real_families[name][1])}
    assert wrong == {}
    read = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_requests_waiting_by_reason", "vllm:cache_config_info",
            "vllm:time_to_first_token_seconds", "vllm:request_success"}
    assert read - set(real_families) == set() and read - set(sim_families) == set()


@pytest.fixture(scope="module")
def traced_gateway(engine: Engine, otlp: OtlpReceiver, tiny_model: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tracing gateway whose replicas are taken in turn: a simulated one that always fails
    (500) and the real engine, so a request that starts on the first is retried on vLLM."""
    with sim("vllm", "tiny", 1024, "--tokenizer", str(tiny_model), "--error-rate", "1.0",
             "--profile", "instant") as failing, pytest.MonkeyPatch.context() as env:
        for name, value in FAST_EXPORT.items():
            env.setenv(name, value)
        config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "replicas": [
            {"url": failing, "engine": "vllm", "name": "failing"},
            {"url": engine.url, "engine": "vllm", "name": "vllm-real"}]}],
                  "balancer": "round_robin", "outlier": {"consecutive_failures": 1000},
                  "health": {"interval": 0.5, "timeout": 10.0},
                  "tracing": {"enabled": True, "endpoint": otlp.url, "service_name": "gateway"}}
        with gateway_server(tmp_path_factory.mktemp("traced"), config) as (url, _):
            yield url


def _request_span(spans: list[Span], request_id: str) -> Span | None:
    return next((s for s in spans if s.attributes.get("llm_gateway.request_id") == request_id),
                None)


@pytest.mark.parametrize("path,body", [
    # (Greedy: sampled, the random model once wrote its EOS after 3 tokens.)
    ("/v1/completions", {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8,
                         "temperature": 0, "stream": True}),
    ("/generate_stream", {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 8}}),
], ids=["openai", "tgi-translated"])
def test_the_engines_span_is_under_the_gateways_attempt(traced_gateway: str, otlp: OtlpReceiver,
                                                        path: str, body: dict[str, Any]) -> None:
    ids = [f"{path}-{i}" for i in range(2)]  # in turn: one at least starts on the failing one
    for request_id in ids:
        with httpx.stream("POST", traced_gateway + path, json=body, timeout=60,
                          headers={"x-request-id": request_id}) as r:
            assert r.status_code == 200
            r.read()

    def retried(spans: list[Span]) -> Span | None:
        return next((s for s in map(lambda i: _request_span(spans, i), ids)
                     if s is not None and s.attributes["llm_gateway.retries"] == 1), None)

    def engine_span_of(spans: list[Span], attempt: Span) -> Span | None:
        return next((s for s in spans if s.service == "vllm-engine"
                     and s.parent_id == attempt.span_id), None)

    def complete(spans: list[Span]) -> bool:
        root = retried(spans)
        if root is None:
            return False
        attempts = [s for s in children(spans, root) if s.kind == "client"]
        return len(attempts) == 2 and any(engine_span_of(spans, a) for a in attempts)

    spans = otlp.wait_for(complete, timeout=30, what="the gateway's and the engine's spans")
    root = retried(spans)
    assert root is not None and root.service == "gateway"
    first, second = sorted((s for s in children(spans, root) if s.kind == "client"),
                           key=lambda s: s.start)
    assert first.error and first.attributes["llm_gateway.replica"] == "failing"
    assert not second.error and second.attributes["llm_gateway.replica"] == "vllm-real"
    engine_span = engine_span_of(spans, second)
    assert engine_span is not None and engine_span.trace_id == root.trace_id
    assert engine_span_of(spans, first) is None  # the failing replica is no vLLM
    assert second.start <= engine_span.start and engine_span.end <= second.end + 50_000_000
    assert second.attributes["gen_ai.usage.output_tokens"] == 8


def _greedy(base: str, model: str, prompt: str = "The quick brown fox") -> httpx.Response:
    return _post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                           "temperature": 0})


def test_alias_and_adapter_discovered_and_answered_as_the_engine(gateway: str,
                                                                  engine: Engine) -> None:
    """`--served-model-name tiny tiny-alias` and `--lora-modules sql=DIR`: the gateway lists
    what the engine lists (the adapter with `parent`), and each name answers as the engine
    answers it; the adapter's greedy text is not the base model's."""
    cards = {c["id"]: c for c in httpx.get(engine.url + "/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "tiny" and cards["tiny-alias"]["parent"] is None
    listed = {c["id"]: c["parent"] for c in httpx.get(gateway + "/v1/models").json()["data"]}
    assert {"tiny": None, "tiny-alias": None, "sql": "tiny"}.items() <= listed.items()
    texts = {}
    for name in ("tiny", "tiny-alias", "sql"):
        through, direct = _greedy(gateway, name), _greedy(engine.url, name)
        assert through.status_code == direct.status_code == 200, through.text
        # vLLM names its first served name for an alias, the adapter for an adapter.
        assert through.json()["model"] == direct.json()["model"] == (
            "tiny" if name == "tiny-alias" else name)
        assert through.json()["choices"] == direct.json()["choices"]
        assert through.json()["usage"] == direct.json()["usage"]
        texts[name] = through.json()["choices"][0]["text"]
    assert texts["tiny"] == texts["tiny-alias"] != texts["sql"]
    # vLLM reports the adapter it ran: max_lora and the running/waiting adapter names.
    info = parse_lora_info(httpx.get(engine.url + "/metrics").text)
    assert info is not None and info[2] == 1


def test_adapter_loaded_at_run_time_through_the_gateway(gateway: str, engine: Engine) -> None:
    """`fin` is in the gateway's load_adapters and not on the engine: the first request loads
    it (POST /v1/load_lora_adapter), and it then answers as the engine answers it."""
    assert "fin" not in {c["id"] for c in httpx.get(engine.url + "/v1/models").json()["data"]}
    through = _greedy(gateway, "fin")
    assert through.status_code == 200, through.text
    direct = _greedy(engine.url, "fin")
    assert through.json()["choices"] == direct.json()["choices"]
    assert "fin" in {c["id"] for c in httpx.get(engine.url + "/v1/models").json()["data"]}


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"model": "tiny", "prompt": "hello world"}),
    ("/tokenize", {"model": "sql", "messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}),
])
def test_tokenize_and_detokenize_answer_as_the_engine(gateway: str, engine: Engine,
                                                      path: str, body: dict[str, Any]) -> None:
    through, direct = _post(gateway, path, body), _post(engine.url, path, body)
    assert through.status_code == direct.status_code == 200, through.text
    assert through.content == direct.content


def test_embeddings_on_a_generate_engine_is_its_404_in_openai_shape(gateway: str) -> None:
    """A generate engine has no /v1/embeddings (vLLM answers FastAPI's 404): OpenAI's shape."""
    r = _post(gateway, "/v1/embeddings", {"model": "tiny", "input": "x"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def embed_gateway(pooling_engine: Engine, tiny_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = {"models": [{"name": "tiny-embed", "tokenizer": str(tiny_model), "replicas": [
        {"url": pooling_engine.url, "engine": "vllm", "name": "embed-0"}]}],
              "admin_token": "real"}
    with gateway_server(tmp_path_factory.mktemp("real-embed"), config) as (url, _):
        yield url


def _without_ids(body: bytes) -> bytes:
    """The answer's bytes with its id and creation time blanked (each answer has its own)."""
    body = re.sub(rb'"id":"[^"]*"', b'"id":""', body)
    return re.sub(rb'"created":\d+', b'"created":0', body)


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"model": "tiny-embed", "input": "the quick brown fox"}),
    ("/v1/embeddings", {"model": "tiny-embed", "input": ["one", "two", "three"]}),
    ("/v1/embeddings", {"model": "tiny-embed", "input": [5, 6, 7, 8]}),
    ("/v1/embeddings", {"model": "tiny-embed", "input": "x", "encoding_format": "base64"}),
    ("/pooling", {"model": "tiny-embed", "input": "pool me"}),
])
def test_embeddings_answer_byte_for_byte_as_the_pooling_engine(
        embed_gateway: str, pooling_engine: Engine, path: str, body: dict[str, Any]) -> None:
    through, direct = _post(embed_gateway, path, body), _post(pooling_engine.url, path, body)
    assert through.status_code == direct.status_code == 200, through.text
    assert _without_ids(through.content) == _without_ids(direct.content)


def test_embeddings_past_the_window_are_a_400_before_the_engine(
        embed_gateway: str, pooling_engine: Engine) -> None:
    """A pooling request costs its input tokens: past the window (1024) it is the gateway's
    400, in OpenAI's shape, as the engine itself refuses it; the ledger ends at zero."""
    body = {"model": "tiny-embed", "input": "fox " * 1100}
    through, direct = _post(embed_gateway, "/v1/embeddings", body), \
        _post(pooling_engine.url, "/v1/embeddings", body)
    assert through.status_code == direct.status_code == 400, through.text
    # The gateway's own 400 (vLLM's says code 400), so the engine never saw it.
    assert through.json()["error"]["code"] == "context_length_exceeded" != \
        direct.json()["error"]["code"]
    replicas = httpx.get(embed_gateway + "/admin/replicas", headers=ADMIN).json()["replicas"]
    assert [(r["in_flight"], r["outstanding_tokens"]) for r in replicas] == [(0, 0)]


def test_a_responses_conversation_reaches_the_engine_that_stored_it(gateway: str,
                                                                    engine: Engine) -> None:
    """Three turns with previous_response_id (the last streamed), the stored response read
    back through the gateway as the engine gives it, usage metered from the stream."""
    previous = None
    for turn in range(2):
        body: dict[str, Any] = {"model": "tiny", "input": f"turn {turn}",
                                "max_output_tokens": 6, "temperature": 0}
        if previous:
            body["previous_response_id"] = previous
        r = _post(gateway, "/v1/responses", body)
        assert r.status_code == 200, r.text
        assert r.json()["previous_response_id"] == previous
        previous = r.json()["id"]
    body = {"model": "tiny", "input": "last", "max_output_tokens": 4, "stream": True,
            "previous_response_id": previous}
    with httpx.stream("POST", gateway + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = r.read()
    events = [e for e in data.split(b"\n\n") if e]
    assert events[0].startswith(b"event: response.created\ndata: {")
    assert events[-1].startswith(b"event: response.completed\ndata: {")
    last = orjson.loads(events[-1].split(b"data: ", 1)[1])["response"]
    assert last["previous_response_id"] == previous
    through = httpx.get(f"{gateway}/v1/responses/{last['id']}")
    direct = httpx.get(f"{engine.url}/v1/responses/{last['id']}")
    assert through.status_code == direct.status_code == 200
    assert through.json() == direct.json()
    unknown = _post(gateway, "/v1/responses", {"model": "tiny", "input": "x",
                                               "previous_response_id": "resp_unknown"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"


def test_the_prefix_token_cache_gives_the_engines_own_prompt_ids(engine: Engine,
                                                                 tiny_model: Path) -> None:
    """Chats sharing a long system prompt, with non-ASCII text and special-token strings in
    the user's text: the ids the gateway takes from its prefix token cache are the ones vLLM
    tokenized (its prompt_token_ids), and most came from the cache."""
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    tokenizer.enable_cache(1 << 20)
    assert tokenizer.cache is not None and tokenizer.cache.exact
    system = "You are a gateway. " * 60 + "Ünïcode é\u0301 日本語 🙂"
    users = ["hi", "  two  spaces\n\nand lines", "é" * 20, "<|im_start|>user\nsneaky",
             "the same system prompt again", "🙂🙂 tail"]
    for i, user in enumerate(users):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        if i % 2:
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
        answer = _post(engine.url, "/v1/chat/completions", {
            "model": "tiny", "messages": messages, "max_tokens": 1,
            "return_token_ids": True}).json()
        ids = tokenizer.token_ids(tokenizer.render_chat(messages), add_special_tokens=False)
        assert ids == answer["prompt_token_ids"], user
    assert tokenizer.cache.hit_tokens > tokenizer.cache.miss_tokens
