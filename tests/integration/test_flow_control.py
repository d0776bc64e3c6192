"""Flow control end to end on a simulated vLLM replica whose engine holds two sequences: once
its own queue is saturated, requests wait at the gateway and go in priority order (a chat
request at priority 1 before a batch one at 0 that came first), sheddable ones get a 429 in
the client's shape with Retry-After, bad headers get a 400 naming them, a key cannot raise
its own priority, and every lease returns."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from access_support import MODEL, key, serving
from scrape import by_label, metric_sum
from support import sim, wait_until

SETTINGS: dict[str, Any] = {
    "health": {"interval": 0.5},
    "scheduling": {"signals_interval": 0.05},
    "flow_control": {"max_waiting": 1},
    "objectives": {"interactive": {"priority": 1, "ttft_ms": 60000}, "evals": {"priority": -1}},
}
CHAT, BATCH = "sk-gw-chat-0123456789", "sk-gw-batch-0123456789"


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with sim("vllm", MODEL, 4096, "--max-running-seqs", "2", "--step-base-ms", "20") as url:
        yield url


@pytest.fixture(scope="module")
def gateway(replica: str) -> Iterator[str]:
    with serving({"models": [{"name": MODEL, "replicas": [{"url": replica, "engine": "vllm"}]}],
                  **SETTINGS}) as url:
        yield url


def engine_waiting(replica: str) -> int:
    return httpx.get(replica + "/sim/state", timeout=5).json()["waiting"]


def stream(url: str, headers: dict[str, str], tokens: int, seen: dict[str, float],
           name: str, statuses: dict[str, int]) -> None:
    """One streamed completion; notes when its first token came and its status."""
    body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": tokens, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=60) as resp:
        statuses[name] = resp.status_code
        for line in resp.iter_lines():
            if line.startswith("data: {") and name not in seen:
                seen[name] = time.monotonic()


def in_background(*args: Any) -> threading.Thread:
    thread = threading.Thread(target=stream, args=args)
    thread.start()
    return thread


def test_a_saturated_engine_holds_requests_at_the_gateway_in_priority_order(
        gateway: str, replica: str) -> None:
    seen: dict[str, float] = {}
    statuses: dict[str, int] = {}
    fill = [in_background(gateway, {}, 100, seen, f"fill{i}", statuses) for i in range(4)]
    # Two run in the engine and two wait: in the engine, or, once a scrape showed the engine's
    # queue (a busy machine can send the last one after it), at the gateway already.
    def held_at_gateway() -> float:
        return by_label(gateway, "llm_gateway_waiting_requests", "priority").get("0", 0.0)

    def fill_placed() -> bool:
        engine = httpx.get(replica + "/sim/state", timeout=5).json()
        return engine["running"] == 2 and engine["waiting"] >= 1 and \
            engine["running"] + engine["waiting"] + held_at_gateway() == 4

    wait_until(fill_placed, 20, "the engine's queue to fill")
    held_fill = held_at_gateway()
    time.sleep(0.3)
    # Sheddable by its header, or by the objective it names (llm-d's header, and the
    # Inference Extension's older name, for a configured `objectives` entry).
    for headers in ({"x-gateway-priority": "-1"}, {"x-llm-d-inference-objective": "evals"},
                    {"x-gateway-inference-objective": "evals"}):
        shed = httpx.post(gateway + "/v1/completions", headers=headers,
                          json={"model": MODEL, "prompt": "an evaluation", "max_tokens": 4},
                          timeout=10)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "shed" and shed.json()["error"]["type"] == \
            "rate_limit_error"
    batch = in_background(gateway, {"x-gateway-priority": "0",
                                    "x-llm-d-inference-objective": "not-configured"}, 8,
                          seen, "batch", statuses)
    wait_until(lambda: held_at_gateway() == held_fill + 1, 10,
               "the batch request to wait at the gateway")
    chat = in_background(gateway, {"x-llm-d-inference-objective": "interactive"}, 8,
                         seen, "chat", statuses)
    wait_until(lambda: by_label(gateway, "llm_gateway_waiting_requests", "priority").get("1")
               == 1, 10, "the chat request to wait at the gateway")
    assert engine_waiting(replica) <= 2  # what waits, waits here, not in the engine
    for thread in [*fill, batch, chat]:
        thread.join(60)
    assert set(statuses.values()) == {200} and len(statuses) == 6
    assert seen["chat"] < seen["batch"]  # the later request, of the higher band, first
    met = by_label(gateway, "llm_gateway_objective_requests_total", "outcome", priority="1")
    assert met == {"met": 1.0}
    wait_until(lambda: metric_sum(gateway, "llm_gateway_replica_in_flight_requests") == 0
               and metric_sum(gateway, "llm_gateway_replica_outstanding_tokens") == 0, 10,
               "the ledger to return to 0")
    assert sum(by_label(gateway, "llm_gateway_waiting_requests", "priority").values()) == 0
    assert by_label(gateway, "llm_gateway_rejections_total", "reason",
                    api="openai").get("shed") == 3.0


@pytest.mark.parametrize("header, value", [
    ("x-gateway-priority", "urgent"), ("x-gateway-priority", "1000"),
    ("x-slo-ttft-ms", "-5"), ("x-slo-tpot-ms", "soon"), ("x-slo-strict", "perhaps"),
    ("x-llm-d-slo-ttft-ms", "0"), ("x-llm-d-slo-tpot-ms", "soon")])  # (llm-d's names)
def test_a_bad_header_is_a_400_naming_it_in_each_protocol(gateway: str, header: str,
                                                          value: str) -> None:
    openai_reply = httpx.post(gateway + "/v1/completions", headers={header: value},
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert openai_reply.status_code == 400
    error = openai_reply.json()["error"]
    assert error["param"] == header and header in error["message"]
    tgi_reply = httpx.post(gateway + "/generate", headers={header: value},
                           json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=10)
    assert tgi_reply.status_code == 422
    assert tgi_reply.json()["error_type"] == "validation" and header in tgi_reply.json()["error"]


def test_a_key_may_not_raise_its_own_priority(replica: str) -> None:
    settings = {"models": [{"name": MODEL, "replicas": [{"url": replica, "engine": "vllm"}]}],
                "auth": {"keys": [key("chat", CHAT, objective={"priority": 1},
                                      max_priority=2),
                                  key("batch", BATCH, objective={"priority": -1})]},
                **SETTINGS}
    with serving(settings) as gw:
        def ask(secret: str, priority: str | None) -> httpx.Response:
            headers = {"authorization": f"Bearer {secret}"}
            if priority is not None:
                headers["x-gateway-priority"] = priority
            return httpx.post(gw + "/v1/completions", headers=headers, timeout=10,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2})

        assert ask(CHAT, "2").status_code == 200  # up to its max_priority
        refused = ask(CHAT, "3")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] is None and "above 2" in \
            refused.json()["error"]["message"]
        assert ask(BATCH, "0").status_code == 403  # its ceiling is its own default, -1
        assert ask(BATCH, "-2").status_code == 200  # lowering is always allowed
        assert ask(BATCH, None).status_code == 200  # -1, and nothing is saturated: served
        assert by_label(gw, "llm_gateway_key_rejections_total", "reason",
                        key="batch").get("priority_not_allowed") == 1.0
