"""`llm-gateway canary report --prometheus URL`: the verdict from the gateways' histograms
and counters alone. The bucket statistics against their per-value counterparts, then a real
`prometheus` scraping a real gateway in front of simulated replicas: on the same traffic the
Prometheus-only report and the sample-based one count the same requests and reach the same
verdicts (a like canary passes, a 30% slower one fails on TTFT), and the Prometheus one
states the resolution it gives up."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
from typing import Iterator

import httpx
import pytest

from gateway.canary.stats import (bucket_value, mann_whitney, mann_whitney_grouped,
                                  median_change_grouped)
from gateway.metrics import LATENCY_BUCKETS
from prometheus_support import prometheus
from canary_support import weighted_pools
from support import ROOT, gateway_server, sim, wait_until

MODEL = "sim-model"
TOKEN = "prom-report-admin-token"
# Chosen off the bucket bounds: TTFT ~41-45 ms (25-50 ms bucket) against ~53-58 ms (50-75),
# ITL ~20 ms against ~26 ms, so the buckets can tell the slow canary apart.
PACED = ("--profile", "paced", "--ttft-ms", "40", "--itl-ms", "20")


def test_the_rank_test_on_buckets_is_the_rank_test_on_bucket_indices() -> None:
    base = [0, 5, 30, 12, 3, 0]
    can = [1, 2, 10, 25, 9, 1]
    expand = lambda counts: [i for i, c in enumerate(counts) for _ in range(c)]  # noqa: E731
    assert mann_whitney_grouped(base, can) == pytest.approx(mann_whitney(expand(base),
                                                                         expand(can)))


def test_bucket_values_interpolate_as_histogram_quantile_and_stop_at_inf() -> None:
    bounds = [0.1, 0.2, 0.4, float("inf")]
    assert bucket_value([0, 10, 0, 0], bounds, 4.5) == pytest.approx(0.15)  # mid-bucket
    assert bucket_value([0, 0, 0, 5], bounds, 2) == 0.4  # +Inf: its lower bound
    # Two medians inside one bucket look equal: the resolution given up.
    change, *_ = median_change_grouped([0, 50, 0, 0], [0, 50, 0, 0], bounds)
    assert change == 0.0


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(gateway, prometheus) after the same traffic on stable, a like canary and a slow one."""
    tmp = tmp_path_factory.mktemp("prom-report")
    with sim("vllm", MODEL, 4096, *PACED) as stable, sim("vllm", MODEL, 4096, *PACED) as like, \
            sim("vllm", MODEL, 4096, *PACED, "--slowdown", "1.3") as slow:
        pools = weighted_pools(("stable", 50, stable), ("canary", 25, like), ("slow", 25, slow))
        config = {"models": [{"name": MODEL, "pools": pools}], "health": {"interval": 0.5},
                  "admin_token": TOKEN, "canary": {"judge": {"min_samples": 40}}}
        with gateway_server(tmp, config) as (gw, _), \
                prometheus(tmp, gw, [stable, like, slow]) as prom:
            def one(i: int) -> None:
                pool = ("stable", "canary", "slow")[i % 3]
                body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 6, "stream": True}
                with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=30,
                                  headers={"x-gateway-pool": pool}) as response:
                    assert response.status_code == 200
                    response.read()

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                list(pool.map(one, range(240)))
            # Prometheus has scraped the last request
            wait_until(lambda: _prom_total(prom) == 240, 30, lambda: _prom_total(prom),
                       every=0.5)
            yield gw, prom


def _prom_total(prom: str) -> float:
    result = httpx.get(f"{prom}/api/v1/query",
                       params={"query": "sum(llm_gateway_requests_total)"}).json()
    got = result["data"]["result"]
    return float(got[0]["value"][1]) if got else 0.0


def report(*args: str) -> tuple[int, dict | str]:
    done = subprocess.run([sys.executable, "-m", "gateway", "canary", "report", "--model", MODEL,
                           "--baseline", "stable", "--window", "10m", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.returncode, (json.loads(done.stdout) if "--json" in args else
                             done.stdout + done.stderr)


def classes(result: dict) -> dict[str, str]:
    return {m["metric"]: m["class"] for m in result["metrics"]}


@pytest.mark.parametrize("canary,verdict", [("canary", "pass"), ("slow", "fail")])
def test_prometheus_alone_gives_the_sample_based_verdict(observed, canary: str,
                                                        verdict: str) -> None:
    gw, prom = observed
    code_p, from_prom = report("--canary", canary, "--prometheus", prom, "--json")
    code_s, from_samples = report("--canary", canary, "--gateway", gw, "--admin-token", TOKEN,
                                  "--json")
    assert from_prom["requests"] == from_samples["requests"] == {"baseline": 80, "canary": 80}
    assert from_prom["verdict"] == from_samples["verdict"] == verdict
    assert code_p == code_s == (0 if verdict == "pass" else 1)
    assert classes(from_prom)["error_rate"] == "pass"
    if verdict == "fail":  # buckets may blur TTFT's +30% to marginal, never to a pass
        assert classes(from_samples)["ttft"] == "fail"
        assert classes(from_prom)["ttft"] in ("fail", "marginal")
    assert from_prom["samples"]["scope"] == "prometheus"
    for metric in from_prom["metrics"]:
        if metric["metric"] in ("ttft", "itl", "e2e", "tokens_per_s"):
            low, high = metric["resolution"]
            assert low <= metric["change"] <= high
            a0, a1 = metric["median_buckets"]["baseline"]
            assert a0 < metric["baseline_median"] <= a1
    ttft = next(m for m in from_prom["metrics"] if m["metric"] == "ttft")
    assert ttft["median_buckets"]["baseline"][1] in LATENCY_BUCKETS


def test_the_table_states_the_resolution_and_bad_input_is_clear(observed) -> None:
    _, prom = observed
    code, table = report("--canary", "slow", "--prometheus", prom)
    assert code == 1 and re.search(r"^resolution ttft: medians in buckets \(\d+\.0 ms, \d+\.0 ms\] / "
                                   r"\(\d+\.0 ms, \d+\.0 ms\]: the change lies in \[[-+]\d+%, "
                                   r"[-+]\d+%\]", table, re.M), table
    assert "samples: Prometheus alone: bucket counts" in table
    code, out = report("--prometheus", prom)  # no canary
    assert code == 4 and "--baseline and --canary" in out
    code, out = report("--canary", "slow", "--prometheus", "http://127.0.0.1:9")
    assert code == 4 and "cannot query" in out
