"""Streams that survive their engine, on two real vLLM engines (CPU build, the tiny random-weight
Llama, greedy): a stream cut after any token, an engine SIGSTOPped and one SIGKILLed mid-answer.
Every stream through the gateway must read as the same request's uninterrupted answer on a
healthy engine: the same text, token for token (a TGI client's token events: ids, texts,
indices), the same usage and finish reason, one id throughout, no error event.

The random model writes byte tokens whose text vLLM holds back until a later token completes
the character, so cuts fall inside characters as well as between them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from engines import Engine, VllmSpec, restart, vllms
from scrape import by_label, metric_sum, samples
from support import StreamInThread, gateway_server, wait_until
from tee import Cutter, tee

ADMIN = {"authorization": "Bearer real"}
PROMPTS = ("hello world", "The quick brown fox", "xyz", "12", "a", "Once upon a time",
           "faults", "kill me softly")


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[Engine]]:
    # Room for every stream at once (the CPU build's default runs fewer: the rest would wait
    # in the engine's queue and start after the first ended).
    spec = VllmSpec(("--max-num-seqs", "32"))
    with vllms(tiny_model, spec, spec) as both:
        yield both


def config(replicas: dict[str, str], **settings: Any) -> dict:
    return {"models": [{"name": "tiny", "replicas": [
        {"url": url, "engine": "vllm", "name": name} for name, url in replicas.items()]}],
        "balancer": "round_robin", "admin_token": "real",
        # Two engines, the gateway and two dozen clients on two cores: an engine's server
        # was seen to take more than the default 5 s to accept a connection.
        "timeouts": {"connect": 30.0},
        # Every stream to its engine at once: the gateway holds requests while an engine
        # reports more than 5 waiting (scraped), and the first streams had ended before the
        # last were sent.
        "flow_control": {"saturation": False},
        "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3}, **settings}


def request(api: str, prompt: str, tokens: int) -> tuple[str, dict]:
    if api == "tgi":
        return "/generate_stream", {"inputs": prompt, "parameters": {
            "max_new_tokens": tokens, "details": True}}
    body = {"model": "tiny", "max_tokens": tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def answer(api: str, events: list[bytes]) -> dict[str, Any]:
    """What a client reads of a stream, chunking aside (vLLM merges tokens into one chunk
    when it falls behind): text, usage, finish, ids; a TGI client's token events."""
    payloads = [orjson.loads(e.partition(b":")[2]) for e in events
                if e.startswith(b"data:") and not e.endswith(b"[DONE]")]
    assert not any("error" in p for p in payloads), payloads[-1]
    if api == "tgi":
        return {"tokens": [(p["index"], p["token"]["id"], p["token"]["text"]) for p in payloads],
                "generated_text": payloads[-1]["generated_text"],
                "details": {k: v for k, v in payloads[-1]["details"].items() if k != "seed"}}
    assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1
    choices = [c for p in payloads for c in p["choices"]]
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
    return {"text": text, "finish": [c["finish_reason"] for c in choices if c["finish_reason"]],
            "usage": [p["usage"] for p in payloads if p.get("usage")],
            "ids": {(p["id"], p["created"]) for p in payloads}.__len__()}


class Stream(StreamInThread):
    """One streamed request on a thread, its events kept as they arrive (so a test sees it
    under way)."""

    def __init__(self, gateway: str, api: str, prompt: str, tokens: int) -> None:
        self.api, self.prompt = api, prompt
        path, body = request(api, prompt, tokens)
        super().__init__(gateway + path, body, timeout=300)

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=self.timeout) as response:
                self.status = response.status_code
                self.replica = response.headers.get("x-gateway-replica")
                self.started.set()
                pending = b""
                for data in response.iter_bytes():
                    pending += data
                    *whole, pending = pending.split(b"\n\n")
                    self.events += [e for e in whole if e]
                if pending:  # an error answer's body
                    self.events.append(pending)
        finally:
            self.started.set()

    def read(self) -> dict[str, Any]:
        assert self.status == 200, (self.status, self.events[-2:])
        return answer(self.api, self.events)


def replicas(gateway: str) -> dict[str, dict]:
    listed = httpx.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"]
    return {r["name"]: r for r in listed}


def ledger_settles(gateway: str) -> None:
    wait_until(lambda: all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0
                           for r in replicas(gateway).values()), 30, "every lease to return")


def admin(gateway: str, replica: str, action: str) -> None:
    httpx.post(f"{gateway}/admin/replicas/{replica}/{action}", headers=ADMIN).raise_for_status()


@pytest.mark.parametrize("api", ["completions", "chat", "tgi"])
def test_a_stream_cut_after_any_token_reads_as_the_uninterrupted_one(
        engines: list[Engine], tmp_path: Path, api: str) -> None:
    """The same engine twice: once behind a proxy that cuts the answer after its k-th token
    (k = 1 .. all: inside characters, between them, after the last before the end), once
    straight. Each cut answer goes on on the straight one and reads as the uncut answer."""
    engine = engines[1]
    tokens = 16
    with tee(engine.url, Cutter) as cutter:
        assert isinstance(cutter, Cutter)
        settings = {"outlier": {"consecutive_failures": 1000}}
        with gateway_server(tmp_path, config({"cut": cutter.url, "whole": engine.url},
                                             **settings)) as (gateway, _):
            for prompt in ("hello world", "xyz"):
                path, body = request(api, prompt, tokens)
                expected = answer(api, _events(_on(gateway, path, body, "whole").content))
                for cut in range(1, tokens + 1):
                    cuts, cutter.cut_after = cutter.cuts, cut
                    got = _on(gateway, path, body, "cut")
                    if cutter.cuts == cuts:  # fewer chunks (vLLM merged tokens): the end
                        cutter.cut_after = None
                        assert cut > tokens // 2, f"{prompt!r}: only {cut - 1} chunks"
                        break
                    assert answer(api, _events(got.content)) == expected, \
                        f"{prompt!r} cut after token {cut}"
            # Every cut migrated but those after the finish reason: the gateway wrote the end
            # (counted as each request ends at the gateway: just after its client read it).
            wait_until(lambda: by_label(gateway, "llm_gateway_migrations_total", "reason")
                       .get("disconnect", 0) == cutter.cuts - cutter.ended, 10,
                       lambda: f"{cutter.cuts - cutter.ended} of {cutter.cuts} cuts migrated: "
                               f"{_migration_metrics(gateway)}")
            ledger_settles(gateway)


def _events(content: bytes) -> list[bytes]:
    return [e for e in content.split(b"\n\n") if e]


def _on(gateway: str, path: str, body: dict, replica: str) -> httpx.Response:
    """The request through the gateway, sent again until it starts on ``replica``."""
    for _ in range(4):  # round robin: every other one
        got = httpx.post(gateway + path, json=body, timeout=120)
        if got.headers["x-gateway-replica"] == replica:
            return got
    raise AssertionError(f"no answer started on {replica}")


def _mid_answer(gateway: str, victim: Engine, other: Engine, count: int,
                tokens: int = 900) -> tuple[list[Stream], dict]:
    """``count`` streams of each protocol on the victim (the other replica drained while they
    start), every one under way; their uninterrupted answers, from the other engine first
    (the victim drained). The streams are sent while the victim is paused (SIGSTOP), so its
    server takes them all at once when it resumes: sent to a running engine, they began one
    after another (its server, busy streaming on two cores, was seen to begin one a second)
    and the first ones had ended before the last began."""
    kinds = [(api, PROMPTS[i % len(PROMPTS)]) for api in ("completions", "chat", "tgi")
             for i in range(count)]
    admin(gateway, "victim", "drain")
    references = {kind: Stream(gateway, *kind, tokens) for kind in set(kinds)}
    expected = {kind: s.join().read() for kind, s in references.items()}
    admin(gateway, "victim", "undrain")
    admin(gateway, "other", "drain")
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    try:
        streams = [Stream(gateway, api, prompt, tokens) for api, prompt in kinds]
        wait_until(lambda: replicas(gateway)["victim"]["in_flight"] == len(streams), 30,
                   lambda: f"every stream sent: {replicas(gateway)['victim']}")
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)
    wait_until(lambda: all(len(s.events) >= 12 for s in streams)
               or any(not s.thread.is_alive() for s in streams), 240,
               lambda: f"every stream under way: {[len(s.events) for s in streams]}",
               every=0.05)
    # Most mid-answer: on a loaded machine a few were seen to end first (18 of 24 under way);
    # those that did are still read against their reference below.
    assert len(under_way(streams)) >= len(streams) // 2, \
        [(len(s.events), s.thread.is_alive(), s.events[-1:]) for s in streams]
    # The wait above ends when one stream ended too; under load another may not have had its
    # answer's head yet (its replica unknown): every head first, then where each runs.
    wait_until(lambda: all(s.started.is_set() for s in streams), 240,
               lambda: f"every answer begun: {[(s.status, len(s.events)) for s in streams]}")
    assert all(s.replica == "victim" for s in streams), \
        [(s.replica, s.status, s.events[-1:]) for s in streams if s.replica != "victim"]
    admin(gateway, "other", "undrain")
    return streams, expected


def under_way(streams: list[Stream]) -> list[Stream]:
    """The streams that began (a token) and have not ended."""
    return [s for s in streams if s.thread.is_alive() and len(s.events) >= 2]


def _serving_or_restarted(engine: Engine) -> None:
    """The engine answers a completion within 15 s, or it is (killed and) started again."""
    try:
        httpx.post(engine.url + "/v1/completions", timeout=15, json={
            "model": "tiny", "prompt": "x", "max_tokens": 2}).raise_for_status()
    except httpx.HTTPError:
        engine.kill()
        restart(engine)


def _migration_metrics(gateway: str) -> list:
    return [(name, labels, value) for name, labels, value in samples(gateway)
            if ("migrat" in name or "not_continued" in name or "retries" in name) and value]


def _same(streams: list[Stream], expected: dict) -> None:
    for s in streams:
        s.join()
    for s in streams:
        assert s.read() == expected[(s.api, s.prompt)], (s.api, s.prompt)


def test_a_sigstopped_engine_s_streams_go_on_and_nothing_comes_twice(
        engines: list[Engine], tmp_path: Path) -> None:
    """8 streams of each protocol mid-answer on an engine SIGSTOPped (hung): each goes on
    elsewhere after the stall timeout and reads as its uninterrupted answer; resumed, the
    engine finds its clients gone, and nothing it sends reaches them twice."""
    victim, other = engines
    for engine in engines:  # (a test that failed may have left one stopped)
        _serving_or_restarted(engine)
    # Not shorter: on two shared cores a CPU engine (just restarted then) once sent nothing on
    # any of its 9 streams for 3 s before it was stopped (a slow engine, not a hung one).
    # A stream not yet begun is retried after the first-token timeout instead.
    settings = {"migration": {"stall_timeout": 8.0}, "timeouts": {"connect": 30.0,
                                                                  "first_token": 30.0}}
    with gateway_server(tmp_path, config({"victim": victim.url, "other": other.url},
                                         **settings)) as (gateway, _):
        streams, expected = _mid_answer(gateway, victim, other, 8)
        stopped = len(under_way(streams))
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        try:
            _same(streams, expected)
        finally:
            os.killpg(victim.proc.pid, signal.SIGCONT)
        # (counted as each request ends at the gateway: just after its client read its end)
        wait_until(lambda: by_label(gateway, "llm_gateway_migrations_total", "reason")
                   .get("stall") == stopped, 10,
                   lambda: f"{stopped} stalls: {_migration_metrics(gateway)}")
        ledger_settles(gateway)
        # Resumed, the engine finds its clients gone and drops their requests.
        wait_until(lambda: victim.metric("vllm:num_requests_running") == 0, 60,
                   "the resumed engine to drop the streams it lost")


def test_a_sigkilled_engine_costs_no_stream_that_had_started(engines: list[Engine],
                                                               tmp_path: Path) -> None:
    # Last in the module: the engine it kills is not started again (a minute on two cores).
    """8 streams of each protocol mid-answer on an engine SIGKILLed (a GPU fault, an OOM
    kill): all 24 complete, each its uninterrupted answer. The gap the migration added is
    printed (``-s``) from the gateway's own histogram."""
    victim, other = engines
    with gateway_server(tmp_path, config({"victim": victim.url, "other": other.url})) \
            as (gateway, _):
        streams, expected = _mid_answer(gateway, victim, other, 8)
        cut = len(under_way(streams))
        killed = time.monotonic()
        victim.kill()
        _same(streams, expected)
        print(f"{cut} streams continued in {time.monotonic() - killed:.1f}s after the kill")
        wait_until(lambda: by_label(gateway, "llm_gateway_migrations_total", "reason")
                   .get("disconnect") == cut, 10,
                   lambda: f"{cut} migrated: {_migration_metrics(gateway)}")
        assert metric_sum(gateway, "llm_gateway_streams_not_continued_total") == 0
        gap = {labels.get("le"): value for name, labels, value in samples(gateway)
               if name == "llm_gateway_migration_gap_seconds_bucket"}
        print("migration gap buckets:", gap)
        ledger_settles(gateway)
