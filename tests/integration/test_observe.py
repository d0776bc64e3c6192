"""Tracing and the access log end to end: a real gateway process exporting OTLP/HTTP to a
loopback receiver that decodes the real protobuf, in front of simulated replicas.

- A streamed request whose first attempt fails (an injected 500) is one trace: the
  request's span, two attempt spans under it (the first failed), all in the client's trace
  when it sent a ``traceparent``.
- A TGI request translated to a vLLM replica carries the same attributes as an OpenAI one.
- 1,000 mixed requests (both APIs, streamed and whole, refused, failed and retried): the
  access log's lines agree with the gateway's own Prometheus counters.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Iterator

import aiohttp
import httpx
import orjson
import pytest

from gateway.access.secret import hash_secret
from otlp_receiver import OtlpReceiver, Span, children
from scrape import metric_sum
from support import gateway_server, sim

MODEL = "sim-model"
PACED = ("--profile", "paced", "--ttft-ms", "2", "--itl-ms", "1")
INSTANT = ("--profile", "instant")
ATTEMPT_SPAN = f"text_completion {MODEL}"
# Spans leave the gateway's batch processor this often (the SDK's variable).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def traced(otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory,
           model_dir: Path) -> Iterator[tuple[str, Path]]:
    """(gateway URL, access log path): a replica that always fails (500) and one that
    serves, taken in turn, so every other request is retried; a canary pool shadows them
    (every request copied)."""
    tokenizer = ("--tokenizer", str(model_dir))
    with sim("vllm", MODEL, 4096, *tokenizer, *PACED, "--error-rate", "1.0") as failing, \
            sim("vllm", MODEL, 4096, *tokenizer, *PACED) as serving, \
            sim("vllm", MODEL, 4096, *tokenizer, *INSTANT) as shadow:
        path = tmp_path_factory.mktemp("traced")
        log = path / "access.log"
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir), "pools": [
                      {"name": "stable", "replicas": [{"url": failing, "name": "failing"},
                                                      {"url": serving, "name": "serving"}]},
                      {"name": "canary", "shadow_of": "stable", "sample": 1.0,
                       "replicas": [{"url": shadow, "name": "shadow"}]}]}],
                  "balancer": "round_robin", "health": {"interval": 0.5, "timeout": 1.0},
                  # the failing replica stays in (its failures are the point)
                  "outlier": {"consecutive_failures": 1000},
                  "tracing": {"enabled": True, "endpoint": otlp.url, "service_name": "gw-test"},
                  "access_log": {"enabled": True, "path": str(log), "flush_interval": 0.05}}
        with pytest.MonkeyPatch.context() as env:
            for name, value in FAST_EXPORT.items():
                env.setenv(name, value)
            with gateway_server(path, config) as (url, _):
                yield url, log


def request_span(spans: list[Span], request_id: str) -> Span | None:
    return next((s for s in spans if s.attributes.get("llm_gateway.request_id") == request_id),
                None)


def log_lines(path: Path) -> dict[str, dict]:
    return {line["request_id"]: line for line in map(orjson.loads, path.read_bytes().splitlines())}


def test_a_streamed_request_with_a_retry_is_one_trace(traced: tuple[str, Path],
                                                      otlp: OtlpReceiver) -> None:
    url, log = traced
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    ids = [f"retry-{i}" for i in range(2)]  # round robin: one at least starts on the failing one
    for request_id in ids:
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True},
                headers={"x-request-id": request_id,
                         "traceparent": f"00-{client_trace}-{client_span}-01"}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == request_id
            assert r.read().endswith(b"data: [DONE]\n\n")
    spans = otlp.wait_for(lambda s: all(request_span(s, i) for i in ids)
                          and sum(x.name == ATTEMPT_SPAN for x in s) >= 3, what="both traces")
    retried = [request_span(spans, i) for i in ids]
    retried = [s for s in retried if s.attributes["llm_gateway.retries"] == 1]
    assert retried
    root = retried[0]
    trace = otlp.trace(root.trace_id)
    assert root.trace_id == client_trace and root.parent_id == client_span  # continued
    assert root.kind == "server" and root.service == "gw-test"
    assert root.attributes["http.response.status_code"] == 200
    attempts = sorted((s for s in children(trace, root) if s.name == ATTEMPT_SPAN),
                      key=lambda s: s.start)
    assert len(attempts) == 2
    first, second = attempts
    assert first.error and first.attributes["error.type"] == "http_5xx"
    assert first.attributes["llm_gateway.replica"] == "failing"
    assert first.attributes["http.response.status_code"] == 500
    assert not second.error and second.attributes["llm_gateway.replica"] == "serving"
    assert [name for name, _ in second.events] == ["first_token"]
    assert second.attributes["gen_ai.usage.output_tokens"] == 5
    assert second.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert first.end <= second.start and root.start <= first.start and second.end <= root.end
    assert {s.name for s in children(trace, root)} >= {"admission", ATTEMPT_SPAN}
    # The access log names the same trace and the retry.
    lines = otlp.wait_for(lambda _: len(log_lines(log)) >= 2, what="log") and log_lines(log)
    line = lines[root.attributes["llm_gateway.request_id"]]
    assert line["trace_id"] == client_trace and line["retries"] == 1
    assert line["replica"] == "serving" and line["output_tokens"] == 5


def test_a_tgi_request_translated_to_vllm_carries_the_same_attributes(
        traced: tuple[str, Path], otlp: OtlpReceiver) -> None:
    url, _ = traced
    openai_id, tgi_id = "attrs-openai", "attrs-tgi"
    for _ in range(1):
        r = httpx.post(url + "/v1/completions", headers={"x-request-id": openai_id},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True})
        assert r.status_code == 200
        r = httpx.post(url + "/generate_stream", headers={"x-request-id": tgi_id},
                       json={"inputs": "hi", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200
    spans = otlp.wait_for(lambda s: request_span(s, openai_id) and request_span(s, tgi_id),
                          what="spans")

    def served(request_id: str) -> tuple[Span, Span]:
        root = request_span(spans, request_id)
        assert root is not None
        attempt, = (s for s in children(spans, root) if s.name == ATTEMPT_SPAN and not s.error)
        return root, attempt

    (o_root, o_attempt), (t_root, t_attempt) = served(openai_id), served(tgi_id)
    assert set(o_root.attributes) == set(t_root.attributes)
    assert set(o_attempt.attributes) == set(t_attempt.attributes)
    assert t_root.attributes["llm_gateway.api"] == "tgi"
    assert t_root.attributes["http.route"] == "/generate_stream"
    for key in ("gen_ai.request.model", "gen_ai.usage.output_tokens"):
        assert o_attempt.attributes[key] == t_attempt.attributes[key], key
    assert o_root.attributes["gen_ai.request.max_tokens"] == t_root.attributes[
        "gen_ai.request.max_tokens"]
    assert t_attempt.attributes["gen_ai.usage.input_tokens"] > 0
    assert t_attempt.attributes["gen_ai.response.finish_reasons"] == ["length"]


def test_nothing_of_the_prompt_or_the_key_secret_is_exported(traced: tuple[str, Path],
                                                              otlp: OtlpReceiver) -> None:
    url, log = traced
    secret = "PROMPT-SECRET-7f3a"
    r = httpx.post(url + "/v1/chat/completions", headers={"x-request-id": "no-text",
                                                          "authorization": "Bearer sk-XYZSECRET"},
                   json={"model": MODEL, "max_tokens": 3,
                         "messages": [{"role": "user", "content": secret}]})
    assert r.status_code == 200
    spans = otlp.wait_for(lambda s: request_span(s, "no-text") is not None, what="span")
    text = repr([(s.name, s.attributes, s.events) for s in spans])
    assert secret not in text and "XYZSECRET" not in text and r.json()["choices"][0]["message"][
        "content"][:20] not in text
    otlp.wait_for(lambda _: "no-text" in log_lines(log), what="log line")
    raw = log.read_text()
    assert secret not in raw and "XYZSECRET" not in raw


def test_a_shadow_copy_is_a_trace_of_its_own_linked_to_its_primary(
        traced: tuple[str, Path], otlp: OtlpReceiver) -> None:
    url, log = traced
    r = httpx.post(url + "/v1/completions", headers={"x-request-id": "shadowed"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200

    def copy(spans: list[Span]) -> Span | None:
        root = request_span(spans, "shadowed")
        return None if root is None else next(
            (s for s in spans if s.attributes.get("llm_gateway.role") == "shadow"
             and (root.trace_id, root.span_id) in s.links), None)

    spans = otlp.wait_for(lambda s: copy(s) is not None, what="the shadow's span")
    shadow, root = copy(spans), request_span(spans, "shadowed")
    assert shadow.parent_id == "" and shadow.trace_id != root.trace_id
    assert shadow.attributes["llm_gateway.pool"] == "canary"
    otlp.wait_for(lambda _: "shadowed" in log_lines(log), what="the log line")
    assert "shadowed-shadow" not in log_lines(log)  # no client: no access log line


def test_a_client_that_leaves_mid_stream_is_logged_as_such(traced: tuple[str, Path],
                                                          otlp: OtlpReceiver) -> None:
    url, log = traced
    with httpx.stream("POST", url + "/v1/completions", timeout=30, headers={
            "x-request-id": "leaves"}, json={"model": MODEL, "prompt": "x", "max_tokens": 2000,
                                             "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # the first token, then gone
    otlp.wait_for(lambda _: "leaves" in log_lines(log), what="the log line")
    line = log_lines(log)["leaves"]
    assert line["client_left"] and line["status"] == 200 and line["output_tokens"] < 2000
    spans = otlp.wait_for(lambda s: request_span(s, "leaves") is not None, what="span")
    assert request_span(spans, "leaves").attributes["llm_gateway.client_left"] is True


@pytest.mark.parametrize("traceparent,tracestate", [
    (b"not-a-traceparent", b"x" * 8000),
    (b"00-" + b"f" * 32 + b"-" + b"0" * 16 + b"-01", b"=,=,"),  # span id all zeros: invalid
    (b"ff-" + b"1" * 32 + b"-" + b"2" * 16 + b"-zz", "\u00e9t\u00e9".encode("latin-1")),
])
def test_a_hostile_trace_context_is_ignored_and_the_request_served(
        traced: tuple[str, Path], otlp: OtlpReceiver, traceparent: bytes,
        tracestate: bytes) -> None:
    url, _ = traced
    request_id = f"hostile-{hash(traceparent) & 0xffff}"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   headers=[(b"x-request-id", request_id.encode()), (b"traceparent", traceparent),
                            (b"tracestate", tracestate)])
    assert r.status_code == 200
    spans = otlp.wait_for(lambda s: request_span(s, request_id) is not None, what="span")
    root = request_span(spans, request_id)
    assert root is not None and root.parent_id == ""  # a trace of its own


KEYS = {"team-a": "sk-secret-aaaa", "team-b": "sk-secret-bbbb"}  # name -> secret


async def _mixed(url: str, n: int, seed: int) -> dict[str, int]:
    """``n`` requests of every kind, 16 at a time; returns each request id's status."""
    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    limit = asyncio.Semaphore(16)
    kinds = [
        ("/v1/completions", lambda: {"model": MODEL, "prompt": "a b c", "max_tokens": rng.randint(1, 8)}),
        ("/v1/completions", lambda: {"model": MODEL, "prompt": "a b c", "max_tokens": rng.randint(1, 8),
                                     "stream": True}),
        ("/v1/chat/completions", lambda: {"model": MODEL, "max_tokens": rng.randint(1, 8),
                                          "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", lambda: {"model": MODEL, "max_tokens": rng.randint(1, 8), "stream": True,
                                          "messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", lambda: {"inputs": "x y", "parameters": {"max_new_tokens": rng.randint(1, 8)}}),
        ("/generate_stream", lambda: {"inputs": "x y", "parameters": {"max_new_tokens": rng.randint(1, 8)}}),
        ("/v1/completions", lambda: {"model": MODEL, "prompt": "x", "max_tokens": 10**6}),  # 400
        ("/v1/completions", lambda: {"model": "no-such-model", "prompt": "x"}),  # 404
        ("/v1/completions", lambda: {"model": MODEL, "prompt": 7}),  # 400
    ]
    weights = [20, 20, 15, 15, 10, 10, 4, 3, 3]

    async def one(client: aiohttp.ClientSession, i: int) -> None:
        path, body = rng.choices(kinds, weights)[0]
        request_id = f"mixed-{i}"
        secret = rng.choices(list(KEYS.values()) + ["sk-wrong"], [49, 49, 2])[0]  # 2%: 401
        async with limit, client.post(url + path, data=orjson.dumps(body()), headers={
                "x-request-id": request_id, "content-type": "application/json",
                "authorization": f"Bearer {secret}"}) as r:
            await r.read()
            statuses[request_id] = r.status

    # aiohttp: the cheaper client, so the gateway and the replicas get the cores
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        await asyncio.gather(*(one(client, i) for i in range(n)))
    return statuses


def test_the_access_log_of_a_mixed_run_agrees_with_the_metrics(
        tmp_path: Path, model_dir: Path) -> None:
    n = 1000
    tokenizer = ("--tokenizer", str(model_dir))
    with sim("vllm", MODEL, 4096, *tokenizer, *INSTANT) as vllm_a, \
            sim("tgi", MODEL, 4096, *tokenizer, *INSTANT) as tgi, \
            sim("vllm", MODEL, 4096, *tokenizer, *INSTANT, "--error-rate", "0.3") as flaky:
        log = tmp_path / "access.log"
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir), "replicas": [
                      {"url": vllm_a, "name": "a"}, {"url": tgi, "engine": "tgi", "name": "t"},
                      {"url": flaky, "name": "flaky"}]}],
                  "health": {"interval": 0.5, "timeout": 1.0},
                  "auth": {"keys": [{"name": name, "sha256": hash_secret(secret)}
                                    for name, secret in KEYS.items()]},
                  "access_log": {"enabled": True, "path": str(log)}}
        with gateway_server(tmp_path, config) as (url, proc):
            statuses = asyncio.run(_mixed(url, n, seed=32))  # about 2 s here
            metrics = {name: metric_sum(url, name, **labels) for name, labels in [
                ("llm_gateway_requests_total", {"role": "primary"}),
                ("llm_gateway_rejections_total", {}),
                ("llm_gateway_retries_total", {}),
                ("llm_gateway_upstream_errors_total", {}),
                ("llm_gateway_prompt_tokens_total", {"role": "primary"}),
                ("llm_gateway_generation_tokens_total", {"role": "primary"})]}
            key5xx = metric_sum(url, "llm_gateway_requests_total", role="primary",
                                status="5xx")
            per_key = {name: metric_sum(url, "llm_gateway_key_requests_total", key=name)
                       for name in KEYS}
        lines = log_lines(log)  # the gateway has stopped: everything is written
    assert set(lines) == set(statuses)  # one line per request
    assert all(lines[i]["status"] == status for i, status in statuses.items())
    values = list(lines.values())
    attempts = sum(line["attempts"] for line in values)
    retries = sum(line["retries"] for line in values)
    failed_last = sum(1 for line in values if line["attempts"] and line["error"] is not None)
    assert attempts == metrics["llm_gateway_requests_total"]
    assert sum(1 for line in values if not line["attempts"]) == metrics["llm_gateway_rejections_total"]
    assert retries == metrics["llm_gateway_retries_total"] > 0
    assert retries + failed_last == metrics["llm_gateway_upstream_errors_total"]
    assert retries + sum(1 for line in values if line["attempts"] and line["status"] >= 500) == key5xx
    assert sum(line["prompt_tokens"] for line in values) == metrics["llm_gateway_prompt_tokens_total"]
    assert sum(line["output_tokens"] for line in values) == metrics["llm_gateway_generation_tokens_total"]
    assert {line["status"] for line in values} >= {200, 400, 404}
    assert {line["api"] for line in values} == {"openai", "tgi"}
    assert {line["replica"] for line in values} >= {"a", "t"}
    # Keys by name, never their secrets; per key, the admitted requests the metrics count.
    assert {line["key"] for line in values} == {*KEYS, None}
    assert all(line["key"] is None for line in values if line["status"] == 401)
    for name in KEYS:
        assert sum(1 for line in values if line["key"] == name and line["attempts"]) == \
            per_key[name], name
    text = log.read_text()
    assert not any(secret in text for secret in KEYS.values())
