"""The timing model and the faults seen over HTTP, on a real replica process."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import text_generation
import text_generation.errors

from tests.sim.conftest import FAST, state
from tests.support import free_port, running, wait_until

LONG = {"prompt": "hello", "max_tokens": 3000}


def abort_count(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter")


def test_disconnect_frees_slot_and_kv(replica) -> None:
    base = replica("vllm", "--speed", "5")
    with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}) as r:
        chunks = r.iter_bytes()
        next(chunks)
        s = state(base)
        assert s["running"] == 1 and s["kv_used_tokens"] > 0
    wait_until(lambda: state(base)["running"] == 0)
    s = state(base)
    assert s["kv_used_tokens"] == 0 and s["aborted_total"] == 1 and s["in_flight"] == 0
    assert abort_count(base) == 1
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while it waits
        httpx.post(f"{base}/v1/completions", json=LONG, timeout=0.3)
    wait_until(lambda: state(base)["aborted_total"] == 2)
    assert state(base)["kv_used_tokens"] == 0 and abort_count(base) == 2


def test_requests_queue_when_kv_is_full(replica) -> None:
    # Real-time speed and 200 output tokens (~2 s each): the queue lasts long enough to be
    # seen by both polls below even on a slow, shared machine.
    base = replica("vllm", "--kv-capacity-tokens", "600", max_model_len=512)
    threads = [threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                                kwargs={"json": {"prompt": "hello world " * 100, "max_tokens": 200}, "timeout": 60})
               for _ in range(3)]
    for t in threads:
        t.start()
    seen: list[dict] = []

    def queued() -> bool:
        seen.append(state(base))
        return seen[-1]["waiting"] >= 1

    wait_until(queued)  # prompts of ~200 tokens: only two fit in 600 tokens of KV
    assert all(s["running"] <= 2 and s["kv_used_tokens"] <= 601 for s in seen)

    def gauge_shows_queue() -> bool:
        text = httpx.get(f"{base}/metrics").text
        return 'vllm:num_requests_waiting{model_name="sim-model",engine="0"} 1.0' in text

    wait_until(gauge_shows_queue)
    httpx.post(f"{base}/sim/faults", json={"slowdown": 0.01})  # finish quickly
    for t in threads:
        t.join()


def test_prefix_cache_lowers_ttft(replica) -> None:
    # Real time (no --speed): event-loop lag on a loaded machine would be multiplied by a
    # speed-up and could hide the cache's gain (a 2 ms lag is 40 simulated ms at --speed 20).
    base = replica("vllm", "--prefix-cache")
    prompt = "the quick brown fox jumps over the lazy dog " * 150
    ttfts = []
    for _ in range(2):
        before = state(base)
        httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
        after = state(base)
        ttfts.append(after["ttft_sum_s"] - before["ttft_sum_s"])  # simulated seconds
    assert ttfts[1] < 0.5 * ttfts[0] and state(base)["prefix_cache_hit_tokens"] > 0


def test_runtime_faults(replica) -> None:
    base = replica("vllm", *FAST)
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    assert httpx.post(f"{base}/sim/faults", json={"fail_health": True}).json()["fail_health"] is True
    assert httpx.get(f"{base}/health").status_code == 503
    httpx.post(f"{base}/sim/faults", json={"fail_health": False, "error_rate": 1.0, "error_status": 503})
    assert httpx.get(f"{base}/health").status_code == 200
    with pytest.raises(openai.InternalServerError) as exc:
        c.completions.create(model="sim-model", prompt="hi", max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.body["code"] == 503
    assert state(base)["errors_injected_total"] == 1
    assert httpx.post(f"{base}/sim/faults", json={"error_rate": 2}).status_code == 400
    assert httpx.post(f"{base}/sim/faults", json={"nonsense": 1}).status_code == 400
    httpx.post(f"{base}/sim/faults", json={"error_rate": 0, "drop_after": 3})
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 10, "stream": True}) as r:
            r.read()
    httpx.post(f"{base}/sim/faults", json={"drop_after": None, "stall_after": 2})
    got = b""
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 10, "stream": True},
                          timeout=httpx.Timeout(5, read=1.0)) as r:
            for chunk in r.iter_bytes():
                got += chunk
    assert got.count(b"data: {") == 2
    httpx.post(f"{base}/sim/faults", json={"stall_after": None})
    assert c.completions.create(model="sim-model", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    wait_until(lambda: state(base)["in_flight"] == 0)


def test_fault_flags_at_start_in_tgi_shape() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["sim", "--dialect", "tgi", "--port", str(port), *FAST, "--fail-health", "--error-rate", "1"]
    with running(args, f"{base}/sim/state"):  # /health answers 503 from the start
        check_tgi_faults(base)


def check_tgi_faults(base: str) -> None:
    r = httpx.get(f"{base}/health")
    assert r.status_code == 503 and r.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    r = httpx.post(f"{base}/generate", json={"inputs": "hi"})
    assert r.status_code == 500 and r.json()["error_type"] == "generation"
    with pytest.raises(text_generation.errors.GenerationError):
        text_generation.Client(base).generate("hi", max_new_tokens=2)


@pytest.mark.parametrize("dialect,path,body", [
    ("vllm", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                      "stream": True, "stream_options": {"include_usage": True}}),
    ("tgi", "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 5}})])
def test_event_writes_send_each_event_as_its_own_chunk(replica, dialect: str, path: str, body: dict) -> None:
    base = replica(dialect, *FAST, "--event-writes")
    with httpx.stream("POST", f"{base}{path}", json=body) as r:
        chunks = [c for c in r.iter_raw() if c]  # one per HTTP chunk, however TCP delivered them
    events = b"".join(chunks).split(b"\n\n")[:-1]
    assert chunks == [e + b"\n\n" for e in events]
    assert len(events) == (5 + 3 if dialect == "vllm" else 5)  # role, 5 tokens, usage, [DONE]


def test_the_vllm_v1_profile_serves_with_prefix_hits_and_frees_its_blocks(replica) -> None:
    base = replica("vllm", "--profile", "llama3-8b-h100-vllm-v1", "--speed", "20",
                   "--prefix-cache", "--per-token-ms", "0.05")
    body = {"prompt": "hello world " * 200, "max_tokens": 5}
    for _ in range(2):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    s = state(base)
    # the second prompt found the first's full 16-token blocks; nothing is held afterwards
    assert s["prefix_cache_hit_tokens"] >= 16 * ((r.json()["usage"]["prompt_tokens"] - 1) // 16)
    assert s["kv_used_tokens"] == 0 and s["completed_total"] == 2 and s["prefix_cache_blocks"] > 0
