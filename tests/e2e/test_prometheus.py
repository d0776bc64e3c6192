"""The dashboards, proven against a real Prometheus.

A real ``prometheus`` (Debian's package) scrapes a real gateway (uvicorn on loopback) and the
simulated replicas behind it, with the shipped ``deploy/prometheus.yml`` (targets and interval
swapped for the test's), while the test drives traffic. First only what a healthy system
sees (OpenAI streamed and not, TGI; nothing fails or waits): every PromQL expression of every
panel of every dashboard, run through Prometheus's HTTP query API, must return a number, 0
where nothing went wrong (rejections, upstream errors, retries, queue time), not "No data".
Then gateway rejections, engine errors with retries and requests queued for a slot: every
panel still returns a number, and those four show what happened.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import httpx
import openai
import pytest
import yaml

from gateway.access.secret import hash_secret

from prometheus_support import prometheus
from scrape import metric_sum
from support import ROOT, free_port, running, settle, sim, wait_for_value

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
MODEL = "sim-model"
PACED = ("--profile", "paced", "--ttft-ms", "30", "--itl-ms", "15")
T = TypeVar("T")
RATE_WINDOW = "1m"  # $__rate_interval: the whole test's traffic lies inside it

# No skip when it is missing: `make test` installs it (scripts/setup.sh, Debian's `prometheus`).
assert shutil.which("prometheus") and shutil.which("promtool"), "run make test (it installs them)"


def panels(board: dict) -> Iterator[dict]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def expressions() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every target of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def substitute(expr: str) -> str:
    """What Grafana sends for model = our model, pool = All."""
    values = {"model": MODEL, "pool": ".*", "__rate_interval": RATE_WINDOW}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


# --- static checks: the shipped files ---

def test_promtool_accepts_the_shipped_config() -> None:
    result = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_use_a_datasource_variable_never_a_fixed_uid() -> None:
    assert {p.name for p in DASHBOARDS} == {"overview.json", "comparison.json"}
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert {"model", "pool"} <= set(variables)
        ids = [p["id"] for p in panels(board)]
        assert len(ids) == len(set(ids))
        for panel in panels(board):
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                # the gateway's own metrics, beside an engine's where a panel compares them
                assert "llm_gateway_" in target["expr"] or "vllm:" in target["expr"]
        for var in variables.values():
            if var["type"] == "query":
                assert var["datasource"]["uid"] == "${datasource}"
    assert len(uids) == len(DASHBOARDS)


# --- live: Prometheus scraping the gateway under traffic ---

def query(prom: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


MESSAGES = [{"role": "user", "content": "Tell me about gateways."}]


# API keys are on, so the boards' key panels have something to show. The split is sticky by
# key, so each API's traffic alternates between a key that lands in the stable pool (team-a,
# team-c) and one that lands in the canary pool (team-b, team-d).
KEYS = {name: f"sk-gw-prom-{name}-0123456789" for name in ("team-a", "team-b", "team-c",
                                                             "team-d")}


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def client(gw: str, i: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw + "/v1", api_key=KEYS["team-b" if i % 2 else "team-a"],
                         max_retries=0)


def openai_request(gw: str, i: int) -> None:
    if i % 3 == 0:
        client(gw, i).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
    else:
        list(client(gw, i).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                   max_tokens=12, stream=True))


def tgi_request(gw: str, i: int) -> None:
    route = "/generate_stream" if i % 2 else "/generate"
    r = httpx.post(gw + route, json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}},
                   headers=auth("team-d" if i % 2 else "team-c"), timeout=30)
    assert r.status_code == 200, r.text


def drive_healthy(gw: str) -> None:
    """Traffic of a healthy system: every request served, none waits for a slot (at most 4
    at once on 6 slots; TGI requests, which only the TGI replica serves, apart and 2 at once)."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: openai_request(gw, i), range(12)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: tgi_request(gw, i), range(4)))


def drive_troubled(gw: str, replicas: dict[str, str]) -> None:
    """Everything else the dashboards show: queueing, rejections, engine errors, retries."""
    # More concurrent requests than slots (3 replicas x 2): some wait in the gateway's queue.
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda i: openai_request(gw, i), range(20)))
        list(pool.map(lambda i: tgi_request(gw, i), range(4)))
    # Rejections by the gateway itself.
    with pytest.raises(openai.BadRequestError):
        client(gw).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1_000_000)
    with pytest.raises(openai.NotFoundError):
        client(gw).chat.completions.create(model="no-such-model", messages=MESSAGES,
                                           max_tokens=1)
    assert httpx.post(gw + "/v1/completions", content=b"{not json",
                      headers=auth("team-c")).status_code == 400
    # An engine failing: 5xx and retries on another replica (clients still get answers).
    # Prompts new to every replica, so prefix affinity does not steer them all to vllm-b
    # (ties go at random); bounded: until the gateway has met the failing engine.
    errors = _gateway_total(gw, "llm_gateway_upstream_errors_total")
    httpx.post(replicas["vllm-a"] + "/sim/faults", json={"error_rate": 1.0}).raise_for_status()
    try:
        for i in range(40):
            client(gw, i).completions.create(model=MODEL, prompt=f"{time.time()} {i}",
                                             max_tokens=4)
            if _gateway_total(gw, "llm_gateway_upstream_errors_total") > errors:
                break
        else:
            pytest.fail("40 requests and none reached the failing replica vllm-a")
    finally:
        httpx.post(replicas["vllm-a"] + "/sim/faults", json={"error_rate": 0.0})


def scraped(prom: str, gw: str) -> None:
    """Wait (bounded) until Prometheus has scraped the gateway's current request count."""
    served = _gateway_total(gw, "llm_gateway_requests_total")
    wait_for_value(lambda: query(prom, "sum(llm_gateway_requests_total)"),
                   lambda got: got and float(got[0]["value"][1]) == served, 20,
                   f"Prometheus to see {served} requests", every=0.5)


def panel_values(prom: str) -> dict[tuple[str, str, str], list[float]]:
    """(board, panel, expr) -> the values its query returns now."""
    return {(board, title, expr): [float(r["value"][1]) for r in query(prom, substitute(expr))]
            for board, title, expr in expressions()}


def steady(prom: str, read: Callable[[], T]) -> T:
    """``read()``, taken again (bounded) if a scrape failed while it ran. The test scrapes
    every second, so a scrape times out after one: on a loaded machine several in a row can,
    and Prometheus marks every series of that target stale until one succeeds, so a reading
    taken meanwhile sees them vanish. Real panels that lack a number lack it in every
    reading."""
    for _ in range(5):
        start = time.monotonic()
        got = read()
        time.sleep(1)  # a scrape running during the reading has failed or not by now
        window = math.ceil(time.monotonic() - start) + 2  # and the scrape just before it
        failed = query(prom, f"min_over_time(up[{window}s]) == 0")
        if not failed:
            return got
        time.sleep(1)  # pacing: the next scrape before reading again
    pytest.fail(f"a scrape failed during each of five readings: {failed}")


def without_a_number(values: dict[tuple[str, str, str], list[float]]) -> list:
    """Panels that would show "No data": no series, or only NaN."""
    return [key for key, got in values.items() if not any(map(math.isfinite, got))]


# The overview panels a healthy system never increments: 0 there, a number once it happens.
TROUBLE_PANELS = ("Rejections/s by reason", "Upstream errors/s by replica and kind",
                  "Retries/s by failed replica and kind", "Queue time for a free replica slot",
                  "Rejections/s by API key and reason", "Queue time by API key (p95)")
AGREEMENT_PANELS = ("Output agreement by shadow pool", "Greedy agreement by shadow pool")
ENGINE_PANELS = ("Engine queue (waiting requests) per replica",
                 "Engine running requests per replica", "Engine KV cache usage per replica")


def test_every_dashboard_query_returns_a_number_healthy_and_in_trouble(tmp_path: Path) -> None:
    with sim("vllm", MODEL, 4096, *PACED) as vllm_a, sim("vllm", MODEL, 4096, *PACED) as vllm_b, \
            sim("tgi", MODEL, 4096, *PACED) as tgi, sim("tgi", MODEL, 4096, *PACED) as tgi_d:
        replicas = {"vllm-a": vllm_a, "vllm-b": vllm_b, "tgi-c": tgi, "tgi-d": tgi_d}
        config = {
            "models": [{"name": MODEL, "pools": [
                {"name": "stable", "weight": 50,
                 "replicas": [{"url": vllm_a, "engine": "vllm", "name": "vllm-a"},
                              {"url": vllm_b, "engine": "vllm", "name": "vllm-b"}]},
                {"name": "canary", "weight": 50,
                 "replicas": [{"url": tgi, "engine": "tgi", "name": "tgi-c"}]},
                # A copy of every canary request (the canary board's shadow panels).
                {"name": "shadow", "shadow_of": "canary", "sample": 1.0,
                 "replicas": [{"url": tgi_d, "engine": "tgi", "name": "tgi-d"}]}]}],
            "default_model": MODEL,
            "health": {"interval": 0.5, "timeout": 1.0},
            "backpressure": {"max_in_flight_per_replica": 2},
            "auth": {"keys": [{"name": name, "sha256": hash_secret(secret)}
                              for name, secret in KEYS.items()]},
            "canary": {"check_every": 1},  # the verdict panel: the guard judges every second
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        gw = f"http://127.0.0.1:{port}"
        with running(["serve", "--config", str(path), "--port", str(port), "--log-level",
                      "warning"], gw + "/ready"), \
                prometheus(tmp_path, gw, list(replicas.values())) as prom:
            # the first scrapes, before any traffic
            settle(lambda: len(query(prom, "up == 1")), lambda up: up >= 5, 20, every=0.2)
            # Healthy: two rounds with scrapes in between, so rate() sees every series move.
            for _ in range(2):
                drive_healthy(gw)
                time.sleep(2.5)  # pacing: scrapes (1 s) of every target between the rounds
            scraped(prom, gw)
            up, healthy, agreement = steady(prom, lambda: (
                query(prom, "up"), panel_values(prom),
                query(prom, 'llm_gateway_canary_agreement_ratio{canary="shadow"}')))
            assert len(up) == 5 and all(r["value"][1] == "1" for r in up), up
            titles = {title for _, title, _ in healthy}
            assert set(TROUBLE_PANELS + ENGINE_PANELS) <= titles
            assert not without_a_number(healthy), "healthy, panels without a number:\n" + \
                "\n".join(map(str, without_a_number(healthy)))
            for (board, title, _), got in healthy.items():
                if title in TROUBLE_PANELS:
                    assert set(got) == {0.0}, (title, got)  # 0, not "No data"
                if title in ENGINE_PANELS:  # one series per scraped replica
                    assert len(got) == len(replicas), (title, got)
                if title in AGREEMENT_PANELS:  # the shadow engine generates the same text
                    assert got == [1.0], (title, got)
            # The guard's judged agreement of the shadow pool (greedy TGI pairs): all agree,
            # against the default floor.
            judged = {(r["metric"]["metric"], r["metric"]["bound"]): float(r["value"][1])
                      for r in agreement}
            assert judged[("agreement", "estimate")] == 1.0, judged
            assert judged[("agreement", "required")] == 0.9
            assert judged[("agreement", "low")] < 1.0 == judged[("agreement", "high")]

            # In trouble: the same panels, now with what happened.
            for _ in range(2):
                drive_troubled(gw, replicas)
                time.sleep(2.5)  # pacing: scrapes (1 s) of every target between the rounds
            scraped(prom, gw)
            troubled = steady(prom, lambda: panel_values(prom))
            assert not without_a_number(troubled), "panels without a number:\n" + \
                "\n".join(map(str, without_a_number(troubled)))
            for (board, title, _), got in troubled.items():
                if title in TROUBLE_PANELS:
                    assert max(got) > 0, (title, got)

            # The template variables' label_values() queries find the model and both pools.
            for label, match, want in [("model", "llm_gateway_replica_healthy", {MODEL}),
                                       ("pool", f'llm_gateway_replica_healthy{{model=~"{MODEL}"}}',
                                        {"stable", "canary", "shadow"})]:
                values = httpx.get(f"{prom}/api/v1/label/{label}/values",
                                   params={"match[]": match}).json()["data"]
                assert set(values) == want


def _gateway_total(gw: str, name: str) -> float:
    return metric_sum(gw, name)
