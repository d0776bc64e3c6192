"""Metrics users can trust: exact token counts, TTFT that contains the engine's, and one scrape
with the totals of every worker under ``--workers 2``. Real gateway processes (uvicorn on
loopback) in front of simulated replicas; the gateway's ``/metrics`` read as Prometheus would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import orjson
import pytest
import yaml
from prometheus_client import multiprocess
from prometheus_client.parser import text_string_to_metric_families

from gateway.balance.ledger import InProcessLedger
from gateway.fleet.replica import REPLICA_STATES, Replica
from gateway.fleet.engine_signals import EngineSignals
from gateway.upstream.failure import FailureKind
from gateway.metrics import (RETRY_KINDS, UPSTREAM_ERROR_KINDS, GatewayMetrics,
                             NullMetrics, make_metrics)
from gateway.protocol.errors import Api
from gateway.protocol.reasons import REFUSALS, Reason
from gateway.tokens import ModelTokenizer
from scrape import samples
from support import free_port, running, settle, sim, wait_for_value

PACED = ("--profile", "paced", "--ttft-ms", "30", "--itl-ms", "2")

Samples = list[tuple[str, dict[str, str], float]]


def parse(text: str) -> Samples:
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(url: str) -> Samples:
    return samples(url)


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, l, v in samples
               if n == name and all(l.get(k) == want for k, want in labels.items()))


@contextlib.contextmanager
def serve(tmp_path: Path, config: dict, *extra: str,
          env: dict[str, str] | None = None) -> Iterator[str]:
    path = tmp_path / f"gateway-{free_port()}.yaml"
    path.write_text(yaml.safe_dump({"health": {"interval": 0.5, "timeout": 1.0}, **config}))
    port = free_port()
    with running(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning",
                  *extra], f"http://127.0.0.1:{port}/ready", env=env, timeout=40):
        yield f"http://127.0.0.1:{port}"


# --- unit: what a scrape shows, metrics off ---

def test_replica_gauges_show_own_load_and_one_hot_state() -> None:
    metrics = GatewayMetrics()
    replica = Replica("r1", "http://127.0.0.1:1", "vllm", "m", "stable", max_model_len=4096)
    ledger = InProcessLedger()
    metrics.watch_replicas(lambda: [replica], ledger)
    lease = ledger.lease("r1", 100, 20)
    replica.draining = True
    samples = parse(metrics.exposition().decode())
    assert total(samples, "llm_gateway_replica_outstanding_tokens", replica="r1") == 120
    assert total(samples, "llm_gateway_replica_in_flight_requests", replica="r1") == 1
    assert total(samples, "llm_gateway_replica_max_model_len", replica="r1") == 4096
    states = {l["state"]: v for n, l, v in samples if n == "llm_gateway_replica_state"}
    assert states == {s: float(s == "draining") for s in REPLICA_STATES}
    lease.close()
    metrics.retry(replica, FailureKind.HTTP_5XX)
    metrics.queued("m", Api.OPENAI, 0.25)
    samples = parse(metrics.exposition().decode())
    assert total(samples, "llm_gateway_replica_in_flight_requests") == 0
    assert total(samples, "llm_gateway_retries_total", replica="r1", kind="http_5xx",
                 pool="stable", engine="vllm", model="m") == 1
    assert total(samples, "llm_gateway_queue_time_seconds_count", model="m", api="openai") == 1
    assert total(samples, "llm_gateway_queue_time_seconds_sum") == 0.25


async def test_a_scrape_renders_off_the_event_loop_what_the_loop_saw() -> None:
    """/metrics renders in a worker thread (thousands of lines take tens of ms, during which
    no stream on the loop would move); the replicas' own state is read on the loop first,
    as it stood when the scrape came."""
    import threading

    from prometheus_client.registry import Collector

    class RecordsItsThread(Collector):
        def collect(self):  # noqa: ANN201
            threads.append(threading.current_thread())
            return []

    threads: list[threading.Thread] = []
    metrics = GatewayMetrics()
    metrics.registry.register(RecordsItsThread())
    replica = Replica("r1", "http://127.0.0.1:1", "vllm", "m", "stable")
    ledger = InProcessLedger()
    metrics.watch_replicas(lambda: [replica], ledger)
    lease = ledger.lease("r1", 100, 20)
    text = await metrics.scrape()
    lease.close()
    assert threads and threading.main_thread() not in threads
    samples = parse(text.decode())
    assert total(samples, "llm_gateway_replica_outstanding_tokens", replica="r1") == 120
    assert ("llm_gateway_retries_total", 0.0) in {  # the replica's series, started at 0
        (n, v) for n, l, v in samples if l.get("replica") == "r1" and l.get("kind") == "http_5xx"}
    assert total(parse(metrics.exposition().decode()),
                 "llm_gateway_replica_outstanding_tokens", replica="r1") == 0
    assert total(parse((await metrics.scrape()).decode()),
                 "llm_gateway_replica_outstanding_tokens", replica="r1") == 0
    assert await NullMetrics().scrape() == b""


def test_configured_label_sets_start_at_zero_replicas_added_later_too() -> None:
    metrics = GatewayMetrics()
    replicas = [Replica("r1", "http://127.0.0.1:1", "vllm", "m", "stable")]
    metrics.watch_replicas(lambda: replicas, InProcessLedger())
    metrics.start_at_zero(["m"])
    replicas.append(Replica("r2", "http://127.0.0.1:2", "tgi", "m", "canary"))  # e.g. by DNS
    samples = parse(metrics.exposition().decode())
    rejections = {(l["api"], l["reason"]) for n, l, v in samples
                  if n == "llm_gateway_rejections_total" and v == 0}
    assert rejections == {(api.value, reason) for api in Api for reason in REFUSALS}
    assert {l["api"] for n, l, v in samples
            if n == "llm_gateway_queue_time_seconds_count" and v == 0} == {api.value for api in Api}
    for name, kinds in [("llm_gateway_upstream_errors_total", UPSTREAM_ERROR_KINDS),
                        ("llm_gateway_retries_total", RETRY_KINDS)]:
        got = {(l["replica"], l["kind"]) for n, l, v in samples if n == name and v == 0}
        assert got == {(r, k) for r in ("r1", "r2") for k in kinds}
    # One enum: every error the gateway answers has a reason of it, and every reason is some
    # error's (so the label lists, derived from it, leave none out).
    import gateway.app  # noqa: F401 (every module that defines an error)
    from gateway.protocol.errors import GatewayError

    def subclasses(cls: type) -> set[type]:
        return {cls} | {s for sub in cls.__subclasses__() for s in subclasses(sub)}
    reasons = {c.reason for c in subclasses(GatewayError)}
    assert all(isinstance(reason, Reason) for reason in reasons)
    assert reasons | {Reason.CONTEXT_LENGTH} == set(Reason)  # (an engine's context error too)


def test_engine_signals_are_exported_while_fresh() -> None:
    metrics = GatewayMetrics()
    vllm = Replica("v", "http://127.0.0.1:1", "vllm", "m", "p")
    llamacpp = Replica("l", "http://127.0.0.1:2", "llamacpp", "m", "p")
    silent = Replica("s", "http://127.0.0.1:3", "openai", "m", "p")  # never scraped
    metrics.watch_replicas(lambda: [vllm, llamacpp, silent], InProcessLedger(),
                           signals_max_age=3.0)
    now = time.monotonic()
    vllm.signals = EngineSignals(running=5, waiting=2, kv_usage=0.75, scraped_at=now)
    llamacpp.signals = EngineSignals(running=1, waiting=0, scraped_at=now)  # no KV gauge
    samples = parse(metrics.exposition().decode())
    engine = {(n.removeprefix("llm_gateway_engine_"), l["replica"]): v for n, l, v in samples
              if n.startswith("llm_gateway_engine_")}
    assert engine == {("running_requests", "v"): 5, ("waiting_requests", "v"): 2,
                      ("kv_cache_usage_ratio", "v"): 0.75, ("running_requests", "l"): 1,
                      ("waiting_requests", "l"): 0}
    vllm.signals = EngineSignals(running=5, waiting=2, kv_usage=0.75, scraped_at=now - 10)
    samples = parse(metrics.exposition().decode())  # a stale scrape is not shown as current
    assert not {l["replica"] for n, l, v in samples
                if n.startswith("llm_gateway_engine_")} & {"v", "s"}


def test_metrics_off_is_a_no_op_with_the_same_calls() -> None:
    metrics = make_metrics(enabled=False)
    assert isinstance(metrics, NullMetrics)
    replica = Replica("r1", "http://127.0.0.1:1", "vllm", "m", "p")
    meter = metrics.for_replica(replica, Api.OPENAI)
    meter.ttft.observe(1.0)
    meter.requests["2xx"].inc()
    metrics.reject("m", Api.OPENAI, "overloaded")
    metrics.retry(replica, FailureKind.CONNECT)
    metrics.queued("m", Api.TGI, 1.0)
    metrics.watch_replicas(lambda: [replica], InProcessLedger())
    metrics.start_at_zero(["m"])
    assert metrics.exposition() == b""


# --- token truth: counters equal what the clients were told ---

@pytest.fixture(scope="module")
def truth_fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """Three models, one replica each: an engine that reports usage, one that sends no usage
    in streams, and TGI (the default model, for the TGI API)."""
    tmp = tmp_path_factory.mktemp("truth")
    tok = ("--tokenizer", str(model_dir))
    with sim("vllm", "usage", 4096, *tok, *PACED) as usage, \
            sim("vllm", "nousage", 4096, *tok, *PACED, "--no-stream-usage") as nousage, \
            sim("tgi", "tgi", 4096, *tok, *PACED) as tgi:
        config = {"models": [
            {"name": "usage", "tokenizer": str(model_dir),
             "replicas": [{"url": usage, "engine": "vllm", "name": "usage-0"}]},
            {"name": "nousage", "replicas": [{"url": nousage, "engine": "vllm",
                                              "name": "nousage-0"}]},
            {"name": "tgi", "replicas": [{"url": tgi, "engine": "tgi", "name": "tgi-0"}]}],
            "default_model": "tgi", "retries": {"max_attempts": 1}}
        with serve(tmp, config) as url:
            yield {"gateway": url, "usage": usage, "nousage": nousage, "tgi": tgi}


def _sim_ttft_sum(sim_url: str) -> tuple[float, float]:
    samples = scrape(sim_url)
    return (total(samples, "vllm:time_to_first_token_seconds_count"),
            total(samples, "vllm:time_to_first_token_seconds_sum"))


def _gateway_ttft(gateway: str, replica: str) -> tuple[float, float]:
    samples = scrape(gateway)
    return (total(samples, "llm_gateway_time_to_first_token_seconds_count", replica=replica),
            total(samples, "llm_gateway_time_to_first_token_seconds_sum", replica=replica))


def test_token_counters_equal_client_usage_exactly(truth_fleet: dict,
                                                   tokenizer: ModelTokenizer) -> None:
    gw = truth_fleet["gateway"]
    client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0)
    prompt = generated = 0
    streams_with_first_token = forwarded = 0
    messages = [{"role": "user", "content": "Count the tokens of this request exactly."}]

    def add(p: int | None, g: int) -> None:
        nonlocal prompt, generated
        prompt += p or 0
        generated += g

    # Non-streamed OpenAI: the usage in the body.
    for model in ("usage", "nousage"):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=7)
        add(reply.usage.prompt_tokens, reply.usage.completion_tokens)
        reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
        add(reply.usage.prompt_tokens, reply.usage.completion_tokens)
        forwarded += 2

    # Streamed OpenAI, one request at a time, each also checked against the engine's own TTFT.
    for model, include_usage, max_tokens in [("usage", True, 9), ("usage", False, 11),
                                             ("nousage", True, 6), ("nousage", False, 4)]:
        before_gw = _gateway_ttft(gw, f"{model}-0")
        before_sim = _sim_ttft_sum(truth_fleet[model])
        kwargs = {"stream_options": {"include_usage": True}} if include_usage else {}
        chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                     max_tokens=max_tokens, **kwargs))
        after_gw = _gateway_ttft(gw, f"{model}-0")
        after_sim = _sim_ttft_sum(truth_fleet[model])
        content = [c for c in chunks if c.choices and c.choices[0].delta.content]
        usage = [c.usage for c in chunks if c.usage is not None]
        if include_usage and model == "usage":
            assert len(usage) == 1
            add(usage[0].prompt_tokens, usage[0].completion_tokens)
            assert usage[0].completion_tokens == len(content) == max_tokens
        else:  # no usage seen: one token per event; the prompt is not counted without usage
            assert not usage
            add(tokenizer.count_chat(messages) if model == "usage" else 0, len(content))
            assert len(content) == max_tokens
        # One first token each, and the gateway's TTFT contains the engine's.
        assert after_gw[0] - before_gw[0] == 1 and after_sim[0] - before_sim[0] == 1
        gateway_ttft, engine_ttft = after_gw[1] - before_gw[1], after_sim[1] - before_sim[1]
        assert gateway_ttft >= engine_ttft >= 0.029, (gateway_ttft, engine_ttft)
        streams_with_first_token += 1
        forwarded += 1

    # TGI API: counts in the final event's details and in the response headers.
    reply = httpx.post(gw + "/generate", json={"inputs": "Hello there",
                                                "parameters": {"max_new_tokens": 8}})
    assert reply.status_code == 200
    add(int(reply.headers["x-prompt-tokens"]), int(reply.headers["x-generated-tokens"]))
    reply = httpx.post(gw + "/generate", json={"inputs": "Hello again",
                                                "parameters": {"max_new_tokens": 3,
                                                               "details": True}})
    assert reply.json()["details"]["generated_tokens"] == 3
    add(int(reply.headers["x-prompt-tokens"]), reply.json()["details"]["generated_tokens"])
    with httpx.stream("POST", gw + "/generate_stream",
                      json={"inputs": "Stream it", "parameters": {"max_new_tokens": 5,
                                                                  "details": True}}) as r:
        events = [orjson.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 5
    add(events[-1]["details"]["input_length"], events[-1]["details"]["generated_tokens"])
    forwarded += 3
    streams_with_first_token += 1

    # An engine failure before the first token: a 5xx, no first token, no tokens.
    httpx.post(truth_fleet["usage"] + "/sim/faults", json={"error_rate": 1.0}).raise_for_status()
    try:
        with pytest.raises(openai.InternalServerError):
            list(client.chat.completions.create(model="usage", messages=messages, stream=True,
                                                max_tokens=5))
    finally:
        httpx.post(truth_fleet["usage"] + "/sim/faults", json={"error_rate": 0.0})
    forwarded += 1
    # Rejections by the gateway itself: not forwarded, counted by reason, client input never
    # becomes a label value.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="usage", messages=messages, max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model='evil"} 1\nx{', messages=messages, max_tokens=1)

    samples = scrape(gw)
    assert total(samples, "llm_gateway_prompt_tokens_total") == prompt > 0
    assert total(samples, "llm_gateway_generation_tokens_total") == generated > 0
    assert total(samples, "llm_gateway_time_to_first_token_seconds_count") == \
        streams_with_first_token
    assert total(samples, "llm_gateway_requests_total") == forwarded
    assert total(samples, "llm_gateway_requests_total", status="5xx") == 1
    # e2e latency: the requests the engine answered (not the one it failed).
    assert total(samples, "llm_gateway_e2e_request_latency_seconds_count") == forwarded - 1
    assert total(samples, "llm_gateway_upstream_errors_total", replica="usage-0",
                 kind="http_5xx") == 1
    assert total(samples, "llm_gateway_rejections_total", model="usage",
                 reason="context_length") == 1
    assert total(samples, "llm_gateway_rejections_total", model="unknown",
                 reason="unknown_model") == 1
    assert {l["model"] for n, l, _ in samples if "model" in l} <= {"usage", "nousage", "tgi",
                                                                    "unknown"}
    assert total(samples, "llm_gateway_replica_in_flight_requests") == 0


# --- many workers: one scrape, every worker's totals ---

def _requests_by_pid(directory: Path) -> dict[int, float]:
    """Each worker's own requests counter, read from its multiprocess file."""
    out = {}
    for path in directory.glob("counter_*.db"):
        merged = multiprocess.MultiProcessCollector.merge([str(path)])
        out[int(path.stem.split("_")[1])] = sum(
            s.value for m in merged for s in m.samples if s.name == "llm_gateway_requests_total")
    return out


def test_workers_2_one_scrape_shows_the_totals_of_both(tmp_path: Path) -> None:
    directory = tmp_path / "multiproc"
    directory.mkdir()
    (directory / "counter_1.db").write_bytes(b"left over by an earlier run")
    with sim("vllm", "m", 4096, "--profile", "paced", "--ttft-ms", "20", "--itl-ms", "5") as url:
        config = {"models": [{"name": "m", "replicas": [{"url": url, "engine": "vllm",
                                                         "name": "r0"}]}]}
        with serve(tmp_path, config, "--workers", "2",
                   env={"PROMETHEUS_MULTIPROC_DIR": str(directory)}) as gw:
            assert not (directory / "counter_1.db").exists()  # cleaned at start
            body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}

            def one() -> int:  # a new connection each time: the kernel spreads them
                with httpx.Client(timeout=30) as c, c.stream("POST", gw + "/v1/completions",
                                                             json=body) as r:
                    r.read()
                    return r.status_code

            sent = 0
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                for _ in range(10):  # bounded: until both workers have served some
                    assert set(pool.map(lambda _: one(), range(16))) == {200}
                    sent += 16
                    if len([n for n in _requests_by_pid(directory).values() if n]) >= 2:
                        break
            by_pid = _requests_by_pid(directory)
            assert len([n for n in by_pid.values() if n]) == 2, by_pid
            assert sum(by_pid.values()) == sent
            for _ in range(6):  # any worker may answer the scrape: each shows both
                samples = scrape(gw)
                assert total(samples, "llm_gateway_requests_total", status="2xx") == sent
                assert total(samples, "llm_gateway_generation_tokens_total") == 4 * sent
                assert total(samples, "llm_gateway_time_to_first_token_seconds_count") == sent
                assert total(samples, "llm_gateway_replica_healthy", replica="r0") == 1
                states = [(l["state"], v) for n, l, v in samples
                          if n == "llm_gateway_replica_state"]
                assert sorted(states) == sorted((s, float(s == "healthy"))
                                                for s in REPLICA_STATES)
                assert total(samples, "llm_gateway_retries_total", replica="r0") == 0  # a series
                assert any(n == "llm_gateway_retries_total" for n, _, _ in samples)

            # Gauges: in-flight and outstanding summed over the workers' own shares.
            httpx.post(url + "/sim/faults", json={"stall_after": 1}).raise_for_status()
            stuck = 6
            clients = [httpx.Client(timeout=30) for _ in range(stuck)]
            with contextlib.ExitStack() as streams:
                readers = []  # held: a dropped reader closes its response
                for c in clients:
                    streams.enter_context(c)
                    r = streams.enter_context(c.stream("POST", gw + "/v1/completions",
                                                       json={**body, "max_tokens": 50}))
                    readers.append(r.iter_raw())
                    next(readers[-1])  # the first token arrived: the request is in flight
                in_flight = _wait_for(gw, "llm_gateway_replica_in_flight_requests", stuck)
                assert in_flight == stuck
                # The engine's own count, scraped by each worker and published as its gauge.
                assert _wait_for(gw, "llm_gateway_engine_running_requests", stuck) == stuck
                # Each stream got its first token (prompt released): 49 output tokens left.
                assert _wait_for(gw, "llm_gateway_replica_outstanding_tokens",
                                 49 * stuck) == 49 * stuck
            httpx.post(url + "/sim/faults", json={"stall_after": None}).raise_for_status()
            assert _wait_for(gw, "llm_gateway_replica_in_flight_requests", 0) == 0


def _wait_for(gateway: str, name: str, want: float, timeout: float = 10.0) -> float:
    """The gauge's total once it reaches ``want`` (workers publish every second), bounded."""
    return settle(lambda: total(scrape(gateway), name), lambda value: value == want, timeout,
                  every=0.2)


def test_serve_removes_its_own_multiprocess_dir(tmp_path: Path) -> None:
    """Without PROMETHEUS_MULTIPROC_DIR, serve makes a temporary one and removes it at exit."""
    with sim("vllm", "m", 4096, "--profile", "instant") as url:
        config = {"models": [{"name": "m", "replicas": [{"url": url, "engine": "vllm"}]}]}
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
        temp = Path(tempfile.gettempdir())
        before = set(temp.glob("llm-gateway-metrics-*"))
        with serve(tmp_path, config, "--workers", "2") as gw:
            made = set(temp.glob("llm-gateway-metrics-*")) - before
            assert len(made) == 1
            httpx.post(gw + "/v1/completions", json={"model": "m", "prompt": "x",
                                                     "max_tokens": 2}).raise_for_status()
            assert total(scrape(gw), "llm_gateway_requests_total") == 1
        assert not any(p.exists() for p in made)


def test_client_leaving_mid_stream_counts_as_4xx(truth_fleet: dict) -> None:
    gw = truth_fleet["gateway"]
    before = total(scrape(gw), "llm_gateway_requests_total", replica="nousage-0", status="4xx")
    with httpx.stream("POST", gw + "/v1/completions",
                      json={"model": "nousage", "prompt": "hi", "max_tokens": 500,
                            "stream": True}) as r:
        next(r.iter_raw())  # one token, then the client leaves
    samples = wait_for_value(  # the gateway notices the disconnect
        lambda: scrape(gw), lambda s: total(s, "llm_gateway_requests_total",
                                            replica="nousage-0", status="4xx") == before + 1,
        10, "the abandoned stream counted as 4xx", every=0.1)
    assert total(samples, "llm_gateway_replica_in_flight_requests", replica="nousage-0") == 0
