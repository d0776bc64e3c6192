"""Disaggregated prefill/decode end to end on simulated vLLM replicas speaking NixlConnector's
``kv_transfer_params`` (``llm-gateway sim --role prefill|decode``): the client's answer is the
decode replica's, shaped as an aggregated engine's, its prompt prefilled once on a prefill
replica; each phase's failures are retried, refusals happen once, and every lease is
returned."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import httpx

from scrape import by_label, metric_sum
from support import gateway_server, sim, wait_until

MODEL = "m"
SIM = ("--speed", "20", "--kv-transfer-ms-per-block", "1")
PROMPT = "disaggregated serving splits the prompt from the answer " * 12


@contextlib.contextmanager
def fleet(model_dir: Path, tmp: Path, prefills: int = 2, decodes: int = 1, both: int = 0,
          extra: dict[str, Any] | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """A gateway over ``prefills`` prefill, ``decodes`` decode and ``both`` ordinary replicas;
    yields its URL and each replica's by name (p0, p1, d0, ...)."""
    roles = [("p", "prefill")] * prefills + [("d", "decode")] * decodes + [("w", "both")] * both
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        replicas = []
        counts: dict[str, int] = {}
        for prefix, role in roles:
            name = f"{prefix}{counts.setdefault(prefix, 0)}"
            counts[prefix] += 1
            extra_args = (*SIM, "--role", role) if role != "both" else SIM
            urls[name] = stack.enter_context(sim("vllm", MODEL, 4096, "--tokenizer",
                                                 str(model_dir), *extra_args))
            replicas.append({"url": urls[name], "engine": "vllm", "name": name, "role": role})
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir), "replicas": replicas}],
                  "health": {"interval": 0.3, "timeout": 2.0}, **(extra or {})}
        gw, _ = stack.enter_context(gateway_server(tmp, config))
        yield gw, urls


def connector(url: str) -> dict[str, Any]:
    return httpx.get(url + "/sim/state", timeout=5).json()["kv_connector"]


def ledger_is_empty(gw: str) -> bool:
    return (metric_sum(gw, "llm_gateway_replica_outstanding_tokens") == 0
            and metric_sum(gw, "llm_gateway_replica_in_flight_requests") == 0)


def sse(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.split("\n") if line.startswith("data: ")]


def shape(events: list[Any]) -> list[Any]:
    """What a stream says, without what differs between two runs (ids, times)."""
    out = []
    for event in events:
        if isinstance(event, dict):
            event = {k: v for k, v in event.items() if k not in ("id", "created")}
        out.append(event)
    return out


def test_a_request_is_prefilled_on_a_prefill_replica_and_answered_by_a_decode_one(
        model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path) as (gw, urls):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}
        via = httpx.post(gw + "/v1/completions", json=body, timeout=30)
        assert via.status_code == 200 and via.headers["x-gateway-replica"] == "d0"
        # The same request straight to an engine that prefills it itself.
        direct = httpx.post(urls["d0"] + "/v1/completions", json=body, timeout=30)
        assert shape(sse(via.text)) == shape(sse(direct.text))  # the prefill's token not shown
        usage = sse(via.text)[-2]["usage"]
        assert usage["prompt_tokens"] == sse(direct.text)[-2]["usage"]["prompt_tokens"] > 100
        assert usage["completion_tokens"] == 12
        # One prefill, whose KV the decode replica loaded (the direct request computed its own).
        assert sum(connector(urls[p])["sent"] for p in ("p0", "p1")) == 1
        assert connector(urls["d0"])["received"] == 1
        assert connector(urls["d0"])["received_tokens"] == usage["prompt_tokens"]

        # Not streamed, chat, and a TGI client (translated): the same path.
        whole = httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 5})
        assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 5
        assert whole.json()["kv_transfer_params"] is None  # the decode's own answer
        chat = httpx.post(gw + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
            "stream": True})
        assert chat.status_code == 200 and sse(chat.text)[-1] == "[DONE]"
        tgi = httpx.post(gw + "/generate_stream", timeout=30, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}})
        assert tgi.status_code == 200
        assert json.loads(tgi.text.strip().split("\n")[-1][5:])["details"]["generated_tokens"] == 6
        assert connector(urls["d0"])["received"] == 4
        assert sum(connector(urls[p])["sent"] for p in ("p0", "p1")) == 4

        prefills = by_label(gw, "llm_gateway_prefills_total", "outcome")
        assert prefills.get("ok") == 4 and not prefills.get("failed")
        # From the prefill's answer to the first token: streams only (as TTFT).
        assert metric_sum(gw, "llm_gateway_kv_handoff_seconds_count", replica="d0") == 3
        assert metric_sum(gw, "llm_gateway_prefill_seconds_count") == 4
        wait_until(lambda: ledger_is_empty(gw), 5, "every lease returned")


def test_a_failing_prefill_replica_is_retried_on_another_and_then_skipped(
        model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path) as (gw, urls):
        httpx.post(urls["p0"] + "/sim/faults", json={"error_rate": 1.0, "error_status": 503},
                   timeout=5)
        for i in range(10):  # distinct prompts: no prefix affinity, p0 draws ~half
            r = httpx.post(gw + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": f"{i} " + PROMPT, "max_tokens": 3})
            assert r.status_code == 200, r.text
        assert connector(urls["p1"])["sent"] == 10  # every prefill ended on the healthy one
        assert connector(urls["d0"])["received"] == 10
        assert by_label(gw, "llm_gateway_prefills_total", "outcome").get("failed", 0) >= 1

        # Every prefill replica failing: the decode replica prefills for itself.
        httpx.post(urls["p1"] + "/sim/faults", json={"error_rate": 1.0, "error_status": 503},
                   timeout=5)
        r = httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT + " alone", "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "d0"
        assert connector(urls["d0"])["received"] == 10  # no KV to load: computed there
        skipped = by_label(gw, "llm_gateway_prefill_skipped_total", "reason")
        assert skipped.get("failed", 0) + skipped.get("unavailable", 0) >= 1
        wait_until(lambda: ledger_is_empty(gw), 5, "every lease returned")


def test_a_decode_replica_failing_before_its_first_byte_is_retried_with_a_new_prefill(
        model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path, prefills=1, decodes=2) as (gw, urls):
        httpx.post(urls["d0"] + "/sim/faults", json={"error_rate": 1.0, "error_status": 503},
                   timeout=5)
        served = []
        for i in range(6):
            r = httpx.post(gw + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": f"{i} " + PROMPT, "max_tokens": 3, "stream": True})
            assert r.status_code == 200, r.text
            served.append(r.headers["x-gateway-replica"])
        assert set(served) == {"d1"}
        retries = metric_sum(gw, "llm_gateway_retries_total")
        # A 503 reached the engine: the KV it may have taken is not reused, the retry
        # prefills again. So one prefill per attempt.
        assert connector(urls["p0"])["sent"] == 6 + retries
        assert connector(urls["d1"])["received"] == 6
        wait_until(lambda: ledger_is_empty(gw), 5, "every lease returned")


def test_a_decode_replica_breaking_mid_stream_goes_on_on_another_without_a_new_prefill(
        model_dir: Path, tmp_path: Path) -> None:
    """Migration in a P/D fleet: a decode replica that drops the stream after 5 tokens; the
    answer goes on on the other decode replica, which prefills the prompt and the tokens so
    far itself (no second prefill on the prefill replica), and reads as the unbroken one."""
    with fleet(model_dir, tmp_path, prefills=1, decodes=2,
               extra={"balancer": "round_robin",
                      "outlier": {"consecutive_failures": 1000}}) as (gw, urls):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        reference = httpx.post(gw + "/v1/completions", json=body, timeout=30)
        assert reference.status_code == 200
        httpx.post(urls["d0"] + "/sim/faults", json={"drop_after": 5},
                   timeout=5).raise_for_status()
        for _ in range(2):  # round robin: one of two starts on d0
            sent = connector(urls["p0"])["sent"]
            broken = httpx.post(gw + "/v1/completions", json=body, timeout=30)
            if broken.headers["x-gateway-replica"] == "d0":
                break
        assert broken.status_code == 200 and broken.headers["x-gateway-replica"] == "d0"
        assert shape(sse(broken.text)) == shape(sse(reference.text))
        assert connector(urls["p0"])["sent"] == sent + 1  # the first prefill only
        wait_until(lambda: by_label(gw, "llm_gateway_migrations_total", "reason")
                   .get("disconnect") == 1, 5, "the migration counted")
        wait_until(lambda: ledger_is_empty(gw), 5, "every lease returned")


def test_refusals_happen_once_before_any_prefill(model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path, prefills=1) as (gw, urls):
        too_long = httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "word " * 5000, "max_tokens": 3})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        # The engine's own refusal (vLLM caps logprobs at 20): the client's answer, once,
        # from the prefill; the decode replica never sees it.
        refused = httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 21})
        assert refused.status_code == 400 and "logprobs" in refused.text
        assert connector(urls["p0"])["sent"] == 0 and connector(urls["d0"])["received"] == 0
        assert metric_sum(gw, "llm_gateway_prefills_total", outcome="refused") == 1
        assert metric_sum(gw, "llm_gateway_retries_total") == 0
        wait_until(lambda: ledger_is_empty(gw), 5, "every lease returned")


def test_a_request_for_the_prompts_own_logprobs_is_prefilled_where_it_is_answered(
        model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path, prefills=1) as (gw, urls):
        r = httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["prompt_logprobs"]
        assert connector(urls["p0"])["sent"] == 0 and connector(urls["d0"])["received"] == 0
        assert metric_sum(gw, "llm_gateway_prefill_skipped_total",
                            reason="whole_request") == 1


def test_ordinary_replicas_beside_a_pd_pair_take_whole_requests_and_prefill_ones_never_answer(
        model_dir: Path, tmp_path: Path) -> None:
    with fleet(model_dir, tmp_path, prefills=1, decodes=1, both=1) as (gw, urls):
        served = [httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": f"{i} " + PROMPT, "max_tokens": 3}).headers["x-gateway-replica"]
            for i in range(12)]
        assert set(served) <= {"d0", "w0"} and "w0" in served and "d0" in served
        assert connector(urls["d0"])["received"] == served.count("d0")
        assert connector(urls["p0"])["sent"] == served.count("d0")
        roles = by_label(gw, "llm_gateway_replica_role", "role")
        assert set(roles) == {"prefill", "decode", "both"}


def test_a_decode_replica_added_at_run_time_is_prefilled_for(
        model_dir: Path, tmp_path: Path) -> None:
    admin = {"authorization": "Bearer admin-secret"}
    with fleet(model_dir, tmp_path, prefills=1, extra={"admin_token": "admin-secret"}) as (gw, urls), \
            sim("vllm", MODEL, 4096, "--tokenizer", str(model_dir), *SIM, "--role", "decode") as d1:
        added = httpx.post(gw + "/admin/replicas", headers=admin, timeout=30, json={
            "model": MODEL, "url": d1, "name": "d1", "role": "decode"})
        assert added.status_code == 201 and added.json()["role"] == "decode"
        # An engine that cannot hand its KV over is refused the role.
        refused = httpx.post(gw + "/admin/replicas", headers=admin, timeout=30, json={
            "model": MODEL, "url": "http://127.0.0.1:9", "engine": "tgi", "role": "prefill"})
        assert refused.status_code == 409 and "role" in refused.text
        httpx.post(gw + "/admin/replicas/d0/drain", headers=admin, timeout=10)
        r = httpx.post(gw + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "d1"
        assert connector(d1)["received"] == 1 and connector(urls["p0"])["sent"] == 1
