"""`llm-gateway bench` and its load generator, against real simulated replicas and the demo.

The load generator's token counts must agree with the engine's own counters for the same run
(``/sim/state`` and the engine's Prometheus counters), directly and through the gateway.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.bench import report
from benchmarks.harness import stop
from gateway.bench.loadgen import (CONNECT, DISCONNECTED, INCOMPLETE_STREAM, TIMEOUT, Request, Target,
                                   closed_loop, open_loop, poisson_arrivals)
from gateway.bench.workload import Lengths, load_dataset, synthetic_requests
from tests.support import ROOT, free_port, sim, wait_until
from scrape import metric_sum

FLAGS = ["--stream", "--concurrency", "4,8", "--requests", "24", "--prompt-tokens", "uniform:8:40",
         "--output-tokens", "uniform:4:24", "--seed", "3", "--no-progress"]


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def state(url: str) -> dict:
    return httpx.get(url + "/sim/state", timeout=5).json()


def counter(url: str, name: str) -> float:
    return metric_sum(url, name)


def totals(result: dict) -> tuple[int, int, int]:
    levels = [level["overall"] for level in result["levels"]]
    return (sum(s["ok"] for s in levels), sum(s["prompt_tokens"] for s in levels),
            sum(s["output_tokens"] for s in levels))


# --- against one simulated replica ------------------------------------------------------------

@pytest.mark.parametrize("dialect,extra", [
    ("vllm", []), ("vllm", ["--endpoint", "/v1/chat/completions"]),
    ("tgi", ["--api", "tgi"]),
])
def test_token_counts_agree_with_the_engine_counters(tmp_path: Path, dialect: str,
                                                     extra: list[str]) -> None:
    with sim(dialect, "m", 4096, "--profile", "paced", "--ttft-ms", "2", "--itl-ms", "1") as url:
        for stream in (True, False):
            flags = FLAGS if stream else [f for f in FLAGS if f != "--stream"]
            before = state(url)
            out = tmp_path / f"{stream}.json"
            done = bench(url, *flags, *extra, "--json", str(out))
            assert done.returncode == 0, done.stderr
            result = json.loads(out.read_text())
            after = state(url)
            ok, prompt, output = totals(result)
            assert ok == 48 and all(not l["overall"]["errors"] for l in result["levels"])
            assert output == after["generation_tokens_total"] - before["generation_tokens_total"]
            assert prompt == after["prompt_tokens_total"] - before["prompt_tokens_total"]
            assert after["completed_total"] - before["completed_total"] == 48
            if stream:
                s = result["levels"][0]["overall"]
                assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["samples"] > 0
                assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
            assert "| concurrency 4 |" in done.stdout and "| concurrency 8 |" in done.stdout
        if dialect == "vllm":  # the engine's Prometheus counter saw the same tokens
            assert counter(url, "vllm:generation_tokens_total") == state(url)["generation_tokens_total"]


def test_streamed_event_count_equals_usage() -> None:
    """Without usage (a server that sends none) the counted events give the same figure."""
    async def go(url: str) -> None:
        requests = synthetic_requests(20, Lengths.parse("16"), Lengths.parse("uniform:1:30"), seed=5)
        with_usage = await closed_loop(Target(url, stream=True, model="m"), requests, users=5)
        without = await closed_loop(Target(url, stream=True, model="m",
                                           extra_body={"stream_options": {"include_usage": False}}),
                                    requests, users=5)
        for a, b, r in zip(with_usage.records, without.records, requests):
            assert a.ok and b.ok
            assert a.output_tokens == b.output_tokens == b.events == r.max_tokens
            assert a.prompt_tokens == 17 and b.prompt_tokens is None  # 16 words + BOS

    with sim("vllm", "m", 4096, "--profile", "instant") as url:
        asyncio.run(go(url))


# --- through the gateway: the demo, with the same flags --------------------------------------

def test_bench_against_the_demo_agrees_with_every_replica(tmp_path: Path) -> None:
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-m", "gateway", "demo", "--port", str(port),
                             "--no-examples", "--duration", "90"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        replicas: dict[str, str] = {}
        deadline = time.monotonic() + 60
        for line in demo.stdout:  # type: ignore[union-attr]
            m = re.match(r"\s+(gpu\d+-\w+)\s+(http://127\.0\.0\.1:\d+)", line)
            if m:
                replicas[m.group(1)] = m.group(2)
            if line.startswith("Serving") or time.monotonic() > deadline:
                break
        assert len(replicas) == 4, replicas
        before = {name: state(url) for name, url in replicas.items()}
        out = tmp_path / "demo.json"
        done = bench(f"http://127.0.0.1:{port}", *FLAGS, "--json", str(out))
        assert done.returncode == 0, done.stderr
        result = json.loads(out.read_text())
        ok, prompt, output = totals(result)
        assert ok == 48
        generated = {n: state(u)["generation_tokens_total"] - before[n]["generation_tokens_total"]
                     for n, u in replicas.items()}
        prompted = {n: state(u)["prompt_tokens_total"] - before[n]["prompt_tokens_total"]
                    for n, u in replicas.items()}
        assert output == sum(generated.values()) and prompt == sum(prompted.values())
        # per replica, as named by the gateway's x-gateway-replica header
        seen = {name: 0 for name in replicas}
        for level in result["levels"]:
            assert set(level["by_pool"]) == {"default"}
            for name, s in level["by_replica"].items():
                seen[name] += s["output_tokens"]
        assert seen == generated
        assert sum(1 for v in seen.values() if v) >= 2  # the load was spread
        assert "replica:" in done.stdout and "gpu0-vllm" in done.stdout
    finally:
        stop(demo)


# --- load shapes, errors ---------------------------------------------------------------------

def test_open_loop_sends_on_the_seeded_schedule() -> None:
    arrivals = poisson_arrivals(40.0, 30, seed=7)
    assert arrivals == poisson_arrivals(40.0, 30, seed=7) != poisson_arrivals(40.0, 30, seed=8)
    assert all(b > a for a, b in zip(arrivals, arrivals[1:]))

    async def go(url: str) -> None:
        requests = [Request(prompt=" hello" * 4, max_tokens=3, tag="t")]
        run = await open_loop(Target(url, stream=True, model="m"), requests, arrivals,
                              duration=arrivals[19] + 1e-6)
        assert len(run.records) == 20 and all(r.ok and r.tag == "t" for r in run.records)
        for record, offset in zip(run.records, arrivals):
            assert record.due == pytest.approx(run.started + offset)
            assert record.sent >= record.due - 1e-3 and record.output_tokens == 3

    with sim("vllm", "m", 4096, "--profile", "paced", "--ttft-ms", "5", "--itl-ms", "2") as url:
        asyncio.run(go(url))


def test_errors_are_counted_by_kind() -> None:
    async def go(url: str, closed_port: int) -> None:
        requests = [Request(prompt=" hello", max_tokens=8)]
        # an engine that stalls after 2 tokens: the request times out, with the 2 tokens seen
        httpx.post(url + "/sim/faults", json={"stall_after": 2}, timeout=5)
        run = await closed_loop(Target(url, stream=True, model="m"), requests, 2, max_requests=2,
                                timeout=0.5)
        assert [r.error for r in run.records] == [TIMEOUT, TIMEOUT]
        assert all(r.events == 2 for r in run.records)
        httpx.post(url + "/sim/faults", json={"stall_after": None, "drop_after": 3}, timeout=5)
        run = await closed_loop(Target(url, stream=True, model="m"), requests, 1, max_requests=2)
        assert [r.error for r in run.records] == [DISCONNECTED, DISCONNECTED]
        httpx.post(url + "/sim/faults", json={"drop_after": None, "error_rate": 1.0,
                                              "error_status": 503}, timeout=5)
        run = await closed_loop(Target(url, model="m"), requests, 1, max_requests=3)
        assert [r.error for r in run.records] == ["http_503"] * 3
        run = await closed_loop(Target(f"http://127.0.0.1:{closed_port}", model="m"), requests,
                                1, max_requests=2, timeout=2)
        assert [r.error for r in run.records] == [CONNECT, CONNECT]
        s = report.summarize(run)["overall"]
        assert s["errors"] == {"connect": 2} and s["ok"] == 0

    with sim("vllm", "m", 4096, "--profile", "paced", "--ttft-ms", "1", "--itl-ms", "1") as url:
        asyncio.run(go(url, free_port()))


@pytest.mark.parametrize("recording,api", [("vllm-completions-no-usage", "openai"),
                                           ("tgi-generate-stream-no-space", "tgi")])
def test_a_stream_that_ends_without_its_last_event_is_incomplete(recording: str, api: str) -> None:
    from tests.recorded_streams import RECORDINGS
    whole = RECORDINGS[recording].data
    cut = whole[:whole.rstrip(b"\n").rfind(b"\n\n") + 2]  # all but the last event

    async def go() -> list[str | None]:
        bodies = iter([whole, cut])

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for body in bodies:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.I)[1]))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            run = await closed_loop(Target(url, api=api, stream=True, model="m"),
                                    [Request(prompt="hi")], 1, max_requests=2)
        return [r.error for r in run.records]

    assert asyncio.run(go()) == [None, INCOMPLETE_STREAM]


def test_context_overflow_is_an_http_400_through_the_cli() -> None:
    with sim("vllm", "m", 256, "--profile", "instant") as url:
        done = bench(url, "--requests", "3", "--prompt-tokens", "300", "--no-progress")
        assert done.returncode == 1  # every request failed
        assert "http_400 3" in done.stdout


# --- CLI --------------------------------------------------------------------------------------

def test_help_names_every_option() -> None:
    done = subprocess.run([sys.executable, "-m", "gateway", "bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    for option in ("--api", "--endpoint", "--stream", "--model", "--concurrency", "--rate",
                   "--requests", "--duration", "--prompt-tokens", "--output-tokens", "--dataset",
                   "--json", "--plot", "--progress", "--timeout", "uniform:LO:HI"):
        assert option in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "0"], "positive"),
    (["--rate", "x"], "comma-separated"),
    (["--prompt-tokens", "uniform:9:3"], "bad length"),
    (["--concurrency", "2", "--rate", "2"], "not allowed with"),
    (["--requests", "0", "--model", "m"], "--requests"),
    (["--api", "tgi", "--dataset", "/nonexistent.jsonl"], "No such file"),
])
def test_bad_arguments_are_clear_errors(args: list[str], message: str) -> None:
    done = bench("http://127.0.0.1:9", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_progress_json_plot_and_a_dataset(tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "the quick brown fox", "max_tokens": 5, "tag": "a"},
        {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 7},
        {"inputs": "a cat", "max_new_tokens": 3}]) + "\n")
    with sim("tgi", "m", 4096, "--profile", "paced", "--ttft-ms", "2", "--itl-ms", "1") as url:
        before = state(url)
        done = bench(url, "--api", "tgi", "--stream", "--rate", "50,100", "--requests", "6",
                     "--dataset", str(dataset), "--progress", "--json", str(tmp_path / "r.json"),
                     "--plot", str(tmp_path / "r.png"))
        assert done.returncode == 0, done.stderr
        result = json.loads((tmp_path / "r.json").read_text())
        assert [l["rate"] for l in result["levels"]] == [50, 100]
        assert totals(result)[2] == 4 * (5 + 7 + 3) == (state(url)["generation_tokens_total"]
                                                        - before["generation_tokens_total"])
        assert "rate 50/s:" in done.stderr and "12 done" not in done.stderr  # per level
        assert "6/6 done" in done.stderr
        assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    summary = {"overall": {"e2e_ms": {"p50": 1.0, "p99": 2.0}, "output_tokens_per_s": 1.0,
                           "requests_per_s": 1.0}}
    message = report.plot([(1, summary)], str(tmp_path / "x.png"), "users")
    assert "matplotlib is not installed" in message and not (tmp_path / "x.png").exists()


# --- workload and statistics -----------------------------------------------------------------

def test_lengths_and_synthetic_prompts() -> None:
    rng = random.Random(0)
    assert Lengths.parse("7").sample(rng) == 7
    assert all(3 <= Lengths.parse("uniform:3:5").sample(rng) <= 5 for _ in range(100))
    assert all(Lengths.parse("normal:2:50").sample(rng) >= 1 for _ in range(100))
    assert str(Lengths.parse("exp:20")) == "exp:20"
    for bad in ("0", "uniform:5", "normal:-1:2", "zipf:3", "exp:0", ""):
        with pytest.raises(ValueError, match="bad length"):
            Lengths.parse(bad)
    a = synthetic_requests(5, Lengths.parse("10"), Lengths.parse("3"), seed=1)
    assert a == synthetic_requests(5, Lengths.parse("10"), Lengths.parse("3"), seed=1)
    assert len({r.prompt for r in a}) == 5 and all(len(r.prompt.split()) == 10 for r in a)


def test_dataset_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    for content, message in [("{\"prompt\": \"x\"}\nnot json\n", ":2: not JSON"),
                             ("[1]\n", ":1: each line must be a JSON object"),
                             ("{\"text\": \"x\"}\n", ":1: needs a string 'prompt'"),
                             ("{\"prompt\": \"x\", \"max_tokens\": 0}\n", "positive integer"),
                             ("{\"messages\": []}\n", "non-empty list"),
                             ("\n", "no requests")]:
        path.write_text(content)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_dataset(path, Lengths.parse("4"))


def test_percentiles_and_inter_token_gaps() -> None:
    assert report.percentile([], 50) is None
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert report.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    from gateway.bench.loadgen import Record
    r = Record(index=0, due=0.0, chunks=[(1.0, 1), (1.5, 1), (2.5, 4)])
    assert report.inter_token_gaps(r) == [0.5, 0.25, 0.25, 0.25, 0.25]


# --- the suite --------------------------------------------------------------------------------

def test_the_suite_runs_end_to_end_and_writes_json_and_markdown(tmp_path: Path) -> None:
    """Small bounds: this checks the plumbing, not the figures (those are the suite's job).
    Each overhead window is 0.6 s, opened once the first request completed: a loaded CI
    machine once completed no request of 256 fresh connections through the gateway within
    a fixed 0.5 s warm-up and 0.6 s window."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--out", str(tmp_path),
                           "--overhead-seconds", "1.2", "--requests", "16", "--rounds", "1",
                           "--speed", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "suite.json").read_text())
    assert set(result["overhead"]) == {"plain_c1", "plain_c64", "plain_c256",
                                       "stream_c1", "stream_c64", "stream_c256"}
    for key, r in result["overhead"].items():
        assert r["direct"]["requests"] > 0 and r["gateway"]["requests"] > 0, \
            (key, done.stderr[-2000:])
        assert r["direct"]["errors"] == r["gateway"]["errors"] == 0
        assert r["gateway"]["router_cpu_us_per_request"] > 0
    policies = result["balancing"]["policies"]
    assert set(policies) == {"least_outstanding_tokens", "least_requests", "round_robin"}
    for p in policies.values():
        (one,) = p["rounds"]
        assert one["all"]["ok"] == 16 and not one["all"]["errors"] and p["errors"] == 0
        assert one["short"]["ok"] + one["long"]["ok"] == 16
        assert p["median"]["ttft_p99_ms"] == pytest.approx(one["all"]["ttft_ms"]["p99"], abs=0.01)
        assert p["median"]["finish_s"] == one["finish_s"] > 0
    markdown = (tmp_path / "suite.md").read_text()
    assert "## Overhead" in markdown and "## Balancing" in markdown
    assert "least_outstanding_tokens vs round_robin, TTFT p99" in markdown


def test_heterogeneous_workload_and_simulated_time() -> None:
    from benchmarks.suite import heterogeneous_requests, simulated
    requests = heterogeneous_requests(400, seed=1)
    assert requests == heterogeneous_requests(400, seed=1)
    long_ = [r for r in requests if r.tag == "long"]
    assert 0.1 < len(long_) / len(requests) < 0.2
    assert all(300 <= r.max_tokens <= 800 and 3000 <= len(r.prompt.split()) <= 6000 for r in long_)
    summary = {"wall_s": 2.0, "requests_per_s": 10.0, "output_tokens_per_s": 100.0,
               "ttft_ms": {"p50": 5.0, "samples": 7}}
    assert simulated(summary, 4) == {"wall_s": 8.0, "requests_per_s": 2.5,
                                     "output_tokens_per_s": 25.0,
                                     "ttft_ms": {"p50": 20.0, "samples": 7}}


def test_target_endpoints_and_bodies() -> None:
    cases = [("http://127.0.0.1:8080", {}, "/v1/completions"),
             ("http://127.0.0.1:8080/v1", {}, "/v1/completions"),
             ("http://127.0.0.1:8080/proxy/v1/chat/completions", {}, "/proxy/v1/chat/completions"),
             ("http://127.0.0.1:8080/proxy", {"api": "tgi", "stream": True}, "/proxy/generate_stream"),
             ("http://127.0.0.1:8080/x", {"endpoint": "/generate"}, "/generate")]
    for url, kw, endpoint in cases:
        assert Target(url, **kw).endpoint == endpoint
    chat = Target("http://127.0.0.1:8080/v1/chat/completions", model="m", stream=True)
    assert chat.body(Request(prompt="hi", max_tokens=3)) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}}
    tgi = Target("http://127.0.0.1:8080", api="tgi")
    assert tgi.body(Request(messages=[{"role": "user", "content": "a"}], max_tokens=2)) == {
        "inputs": "a", "parameters": {"max_new_tokens": 2, "details": True}}
    for bad in ("ftp://x", "127.0.0.1:8080", "http://"):
        with pytest.raises(ValueError, match="target URL"):
            Target(bad)


def test_round_medians_leave_out_a_round_where_everything_failed() -> None:
    from benchmarks.suite import round_medians
    def ok(p99: float) -> dict:
        return {"all": {"ttft_ms": {"p50": p99 / 4, "p99": p99}, "output_tokens_per_s": p99,
                        "errors": {}},
                "short": {"ttft_ms": {"p50": 1.0, "p99": 2.0}}, "finish_s": 10.0}
    failed = {"all": {"output_tokens_per_s": 0.0, "errors": {"http_500": 3}}, "short": {},
              "finish_s": 1.0}
    m = round_medians([ok(100.0), ok(300.0), ok(200.0)])
    assert m["ttft_p99_ms"] == 200.0 and m["ttft_p50_ms"] == 50.0 and m["finish_s"] == 10.0
    m = round_medians([ok(100.0), failed, ok(300.0)])
    assert m["ttft_p99_ms"] == 200.0 and m["short_ttft_p99_ms"] == 2.0
    assert round_medians([failed])["ttft_p99_ms"] is None


# --- the overhead benchmark's peer rows ---------------------------------------------------------

def test_router_cpu_includes_its_worker_processes() -> None:
    """nginx (and uvicorn with workers) does its work in child processes: the CPU charged to a
    router is its whole process tree's, or nginx would look free."""
    from benchmarks.harness import cpu_seconds, tree_cpu_seconds
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               f"subprocess.run([sys.executable, '-c', {busy!r}])\n"
                               "time.sleep(30)"])
    try:
        wait_until(lambda: tree_cpu_seconds(parent.pid) - cpu_seconds(parent.pid) >= 0.25, 20,
                   "the child's CPU time counted")
    finally:
        parent.kill()
        parent.wait()


def test_peer_table_charges_each_router_and_compares_it_with_vllm_router() -> None:
    from benchmarks.overhead import PACED_SCENARIOS, peer_table

    def figures(rps: float, cpu_token: float | None, ttft_p50: float) -> dict:
        return {"requests_per_s": rps, "tokens_per_s": rps * 256, "ttft_ms": {"p50": ttft_p50},
                "router_cpu_us_per_request": None if cpu_token is None else cpu_token * 256,
                "router_cpu_us_per_token": cpu_token}

    sc = PACED_SCENARIOS[1]
    res = {sc.key: {"scenario": sc.__dict__, "order": ["direct", "gateway", "vllm-router"],
                    "direct": figures(100, None, 10.0), "gateway": figures(99, 60.0, 11.0),
                    "vllm-router": figures(100, 30.0, 10.25)}}
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:-1]]
            for line in peer_table(res).splitlines()[2:]}
    assert rows["gateway"][2:] == ["1.000", "15,360.0", "60.00", "2.00"]
    assert rows["vllm-router"][2:] == ["0.250", "7,680.0", "30.00", "1.00"]


def test_baseline_table_compares_this_checkout_with_the_baseline_round_by_round() -> None:
    from benchmarks.overhead import SCENARIOS, baseline_table

    def figures(cpu_rounds: list[float], p50: float) -> dict:  # non-stream: per request
        return {"router_cpu_us_per_request": sum(cpu_rounds) / len(cpu_rounds),
                "round_cpu_us_per_request": cpu_rounds, "latency_ms": {"p50": p50}}

    def stream_figures(cpu_rounds: list[float], p50: float) -> dict:  # per token event
        return {"router_cpu_us_per_token": sum(cpu_rounds) / len(cpu_rounds),
                "round_cpu_us_per_token": cpu_rounds, "ttft_ms": {"p50": p50}}

    sc = next(s for s in SCENARIOS if not s.stream)
    st = next(s for s in SCENARIOS if s.stream)
    res = {sc.key: {"scenario": sc.__dict__, "order": ["direct", "gateway", "baseline"],
                    "gateway": figures([400.0, 300.0], 2.0),
                    "baseline": figures([500.0, 500.0], 3.0)},
           st.key: {"scenario": st.__dict__, "order": ["direct", "gateway", "baseline"],
                    "gateway": stream_figures([30.0, 45.0], 1.5),
                    "baseline": stream_figures([40.0, 50.0], 1.0)}}
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in baseline_table(res).splitlines()[2:]]
    assert rows == [[sc.what, "500.0 → 350.0", "0.700", "0.80, 0.60", "3.000 → 2.000"],
                    [st.what, "45.00 → 37.50", "0.833", "0.75, 0.90", "1.000 → 1.500"]]
