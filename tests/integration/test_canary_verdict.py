"""The canary verdict end to end: real simulated replicas in a baseline and a canary pool,
traffic through a real gateway, then `llm-gateway canary report` (its exit code) and
`GET /admin/canary/{model}`, which must agree."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from gateway.bench.loadgen import Request, Target, closed_loop
from scrape import metric_sum
from support import ROOT, gateway_server, sim, wait_until

MODEL = "sim-model"
TOKEN = "verdict-admin-token"
# Delays of tens of ms: event-loop jitter on a loaded machine stays small beside them (with
# 2 ms between tokens, identical pools could differ by 10% in inter-token latency; 50 and
# 25 ms keep the 10% thresholds at 2.5-5 ms, for the guard judging every 0.3 s under load).
PACED = ("--profile", "paced", "--ttft-ms", "50", "--itl-ms", "25")
INSTANT = ("--profile", "instant")


@contextlib.contextmanager
def fleet(tmp: Path, baseline: tuple[str, ...], canary: tuple[str, ...],
          **canary_settings: object) -> Iterator[str]:
    with sim("vllm", MODEL, 4096, *baseline) as a, sim("vllm", MODEL, 4096, *canary) as b:
        config = {"models": [{"name": MODEL, "pools": [
            {"name": "stable", "weight": 50, "replicas": [{"url": a, "name": "stable-1"}]},
            {"name": "canary", "weight": 50, "replicas": [{"url": b, "name": "canary-1"}]}]}],
            "health": {"interval": 0.5}, "admin_token": TOKEN,
            "canary": {"judge": {"min_samples": 40}, **canary_settings}}
        with gateway_server(tmp, config) as (url, _):
            yield url


def send(url: str, n: int, stream: bool = True) -> None:
    target = Target(url, model=MODEL, stream=stream)
    run = asyncio.run(closed_loop(target, [Request(prompt="Compare us.", max_tokens=8)],
                                  users=8, max_requests=n, timeout=30))
    assert len(run.records) == n


def report(url: str) -> tuple[int, dict, dict]:
    """(CLI exit code, CLI JSON, admin endpoint JSON)."""
    done = subprocess.run([sys.executable, "-m", "gateway", "canary", "report", "--model", MODEL,
                           "--gateway", url, "--admin-token", TOKEN, "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    admin = httpx.get(f"{url}/admin/canary/{MODEL}",
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    return done.returncode, json.loads(done.stdout), admin


def classes(result: dict) -> dict[str, str]:
    return {m["metric"]: m["class"] for m in result["metrics"]}


def test_identical_pools_pass_and_ten_requests_are_insufficient(tmp_path: Path) -> None:
    with fleet(tmp_path, PACED, PACED) as url:
        send(url, 10)
        code, cli, admin = report(url)
        assert code == 2 and cli["verdict"] == admin["verdict"] == "insufficient data"
        send(url, 190)
        code, cli, admin = report(url)
        assert (cli["baseline"], cli["canary"]) == ("stable", "canary")
        assert code == 0 and cli["verdict"] == admin["verdict"] == "pass", cli
        assert classes(cli)["ttft"] == classes(admin)["ttft"] == "pass"


def test_a_30_percent_slower_canary_fails_on_ttft(tmp_path: Path) -> None:
    with fleet(tmp_path, PACED, (*PACED, "--slowdown", "1.3")) as url:
        send(url, 200)
        code, cli, admin = report(url)
        assert code == 1 and cli["verdict"] == admin["verdict"] == "fail"
        assert classes(cli)["ttft"] == classes(admin)["ttft"] == "fail"
        ttft = next(m for m in cli["metrics"] if m["metric"] == "ttft")
        assert 0.15 < ttft["change"] < 0.45  # ~ +30%, gateway overhead on both sides


def test_five_points_more_errors_fail_the_canary(tmp_path: Path) -> None:
    with fleet(tmp_path, INSTANT, (*INSTANT, "--error-rate", "0.05", "--fault-seed", "3")) as url:
        send(url, 1200, stream=False)
        code, cli, admin = report(url)
        assert code == 1 and cli["verdict"] == admin["verdict"] == "fail"
        errors = next(m for m in cli["metrics"] if m["metric"] == "error_rate")
        assert errors["class"] == "fail" and 2 < errors["change_points"] < 9, errors
        assert classes(admin)["error_rate"] == "fail"


def test_unknown_pools_and_models_are_clear_errors(tmp_path: Path) -> None:
    with fleet(tmp_path, INSTANT, INSTANT) as url:
        auth = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/admin/canary/nope", headers=auth).status_code == 404
        bad = httpx.get(f"{url}/admin/canary/{MODEL}?canary=nope", headers=auth)
        assert bad.status_code == 400 and "nope" in bad.text
        same = httpx.get(f"{url}/admin/canary/{MODEL}?baseline=canary&canary=canary",
                         headers=auth)
        assert same.status_code == 400
        assert httpx.get(f"{url}/admin/canary/{MODEL}").status_code == 401


def test_the_guard_rolls_a_failing_canary_back_and_never_forward(tmp_path: Path) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}

    def canary_weight(url: str) -> float:
        (model,) = httpx.get(f"{url}/admin/models", headers=auth).json()["models"]
        return next(p["weight"] for p in model["pools"] if p["pool"] == "canary")

    def rollbacks(url: str) -> float:
        return metric_sum(url, "llm_gateway_canary_rollbacks_total", pool="canary")

    with fleet(tmp_path, PACED, PACED, auto_rollback=True, check_every=0.3) as url:
        send(url, 120)  # identical pools: the guard leaves the weights alone
        time.sleep(1)  # a window of about three checks in which nothing may change
        assert canary_weight(url) == 50 and rollbacks(url) == 0
    with fleet(tmp_path, PACED, (*PACED, "--slowdown", "1.3"), auto_rollback=True,
               check_every=0.3) as url:
        send(url, 200)
        wait_until(lambda: canary_weight(url) == 0, 10, "the guard to roll the canary back",
                   every=0.2)
        assert rollbacks(url) == 1
        verdict = httpx.get(f"{url}/admin/canary/{MODEL}", headers=auth).json()
        (rollback,) = verdict["rollbacks"]
        assert rollback["pool"] == "canary" and "ttft" in rollback["failed"]
        before = served_by_canary(url)
        send(url, 20)  # all to the baseline now; the guard never raises the weight again
        time.sleep(1)  # a window of about three checks in which nothing may change
        assert canary_weight(url) == 0 and rollbacks(url) == 1
        assert served_by_canary(url) == before


def served_by_canary(url: str) -> float:
    return metric_sum(url, "llm_gateway_requests_total", pool="canary")
