"""Output agreement as a judged metric: the intervals against SciPy and a published example,
the classes against a floor and against a reference pool, and end to end through a real
gateway in front of simulated replicas (a like engine agrees, one with other text does not):
the report's table, its JSON, the CLI's exit code and the guard's gauges."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest
from scipy import stats as scipy_stats

from gateway.canary.verdict import verdict
from gateway.canary.samples import PairSample, Sample
from gateway.canary.stats import proportion_difference, score_test, wilson
from gateway.canary.config import CanaryJudgeConfig
from support import ROOT, gateway_server, sim, wait_until

MODEL = "sim-model"
TOKEN = "agreement-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


# --- the statistics ---

@pytest.mark.parametrize("k,n", [(0, 20), (3, 50), (65, 115), (99, 100), (100, 100)])
def test_wilson_matches_scipy(k: int, n: int) -> None:
    expected = scipy_stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert wilson(k, n) == pytest.approx((expected.low, expected.high), abs=1e-9)


def test_score_test_rejects_exactly_outside_the_wilson_interval() -> None:
    for k in range(0, 101):
        low, high = wilson(k, 100)
        for floor in (0.5, 0.8, 0.9, 0.95):
            outside = not low <= floor <= high
            assert (score_test(k, 100, floor) < 0.05) == outside, (k, floor)


def test_newcombe_difference_matches_the_published_example() -> None:
    # Newcombe (1998), Statistics in Medicine 17:873, example (a): 56/70 - 48/80, method 10.
    d, low, high = proportion_difference(48, 80, 56, 70)
    assert d == pytest.approx(0.2)
    assert (low, high) == pytest.approx((0.0524, 0.3339), abs=1e-4)


# --- the classes ---

NOW = time.time()
CONFIG = CanaryJudgeConfig(min_samples=50)


def requests(n: int = 200) -> list[Sample]:
    return [Sample(NOW, False, 0.05, 0.01, 0.5, 100.0)] * n


def pairs(agreed: int, n: int, prefix: int | None = None, sampled: int = 0,
          dropped: int = 0) -> list[PairSample]:
    prefix = agreed if prefix is None else prefix
    out = [PairSample(NOW, True, True, i < agreed, i < prefix) for i in range(n)]
    out += [PairSample(NOW, False, True, False, False)] * sampled
    return out + [PairSample(NOW, True, False, False, False)] * dropped


def judged(result: dict, name: str = "agreement") -> dict:
    return next(m for m in result["metrics"] if m["metric"] == name)


def test_a_weighted_canary_has_no_agreement_metric() -> None:
    result = verdict(requests(), requests(), CONFIG)
    assert {m["metric"] for m in result["metrics"]} == {"ttft", "itl", "e2e", "tokens_per_s",
                                                        "error_rate"}


@pytest.mark.parametrize("agreed,cls", [(100, "pass"), (92, "pass"), (86, "marginal"),
                                        (65, "fail"), (0, "fail")])
def test_agreement_against_the_floor(agreed: int, cls: str) -> None:
    result = verdict(requests(), requests(), CONFIG, pairs(agreed, 100, sampled=40, dropped=3))
    m = judged(result)
    assert m["class"] == cls and m["canary_n"] == 100 and m["threshold"] == 0.9
    assert m["canary_rate"] == agreed / 100
    assert m["pairs"] == {"greedy_compared": 100, "agreed": agreed, "prefix_agreed": agreed,
                          "not_greedy": 40, "dropped": 3, "skipped": 0}
    low, high = m["canary_ci"]
    assert low <= agreed / 100 <= high
    # agreement is critical by default: its failure fails a canary fine on every latency
    assert result["verdict"] == ("fail" if cls == "fail" else "pass")


def test_prefix_agreement_is_judged_on_its_own_floor() -> None:
    result = verdict(requests(), requests(), CONFIG, pairs(60, 100, prefix=99))
    assert judged(result)["class"] == "fail"
    assert judged(result, "prefix_agreement")["class"] == "pass"


def test_agreement_not_critical_lowers_the_score_only() -> None:
    config = CanaryJudgeConfig(min_samples=50, critical=["ttft"])
    result = verdict(requests(), requests(), config, pairs(10, 100, prefix=10))
    assert judged(result)["class"] == "fail" and not judged(result)["critical"]
    assert result["score"] == pytest.approx(100 * 5 / 7, abs=0.1) and result["verdict"] == "marginal"


def test_too_few_greedy_pairs_are_insufficient_and_left_out_of_the_score() -> None:
    result = verdict(requests(), requests(), CONFIG, pairs(0, 49, sampled=500))
    assert judged(result)["class"] == "insufficient data"
    assert result["verdict"] == "pass" and result["score"] == 100.0


@pytest.mark.parametrize("reference,canary,cls", [((97, 100), (95, 100), "pass"),
                                                  ((97, 100), (65, 100), "fail"),
                                                  ((70, 100), (66, 100), "pass"),
                                                  ((57, 60), (53, 60), "marginal")])
def test_agreement_drop_against_a_reference(reference: tuple[int, int], canary: tuple[int, int],
                                            cls: str) -> None:
    """A reference that agrees with the baseline only 70% of the time (an engine whose greedy
    answers move with the batch) lets a canary at 66% pass: the floor would have failed it."""
    result = verdict(requests(), requests(), CONFIG, pairs(*canary), pairs(*reference), "self")
    m = judged(result)
    assert m["class"] == cls and m["reference"] == "self"
    assert m["baseline_rate"] == reference[0] / reference[1]
    assert m["change_points"] == pytest.approx(100 * (canary[0] / canary[1]
                                                      - reference[0] / reference[1]))
    low, high = m["change_ci"]
    assert low <= m["change_points"] <= high


def test_a_reference_with_too_few_pairs_is_insufficient() -> None:
    result = verdict(requests(), requests(), CONFIG, pairs(65, 100), pairs(10, 10), "self")
    assert judged(result)["class"] == "insufficient data"


# --- end to end ---

@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    """stable takes the traffic; `same` (a like engine) and `other` (--text-seed 7: other
    text) shadow all of it. `same` is the agreement reference only when asked for."""
    paced = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "2")
    with sim("vllm", MODEL, 4096, *paced) as stable, sim("vllm", MODEL, 4096, *paced) as same, \
            sim("vllm", MODEL, 4096, *paced, "--text-seed", "7") as other:
        pools = [{"name": name, "replicas": [{"url": url, "name": f"{name}-1"}]}
                 for name, url in (("stable", stable), ("same", same), ("other", other))]
        for shadow in pools[1:]:
            shadow.update(shadow_of="stable", sample=1.0)
        config = {"models": [{"name": MODEL, "pools": pools}], "health": {"interval": 0.5},
                  "admin_token": TOKEN,
                  "canary": {"check_every": 0.5, "judge": {"min_samples": 20}}}
        with gateway_server(tmp_path_factory.mktemp("agreement"), config) as (url, _):
            with httpx.Client(base_url=url, timeout=30) as client:
                for i in range(30):  # greedy, streamed and not; and a few sampled ones
                    body = {"model": MODEL, "prompt": f"Agree with me, take {i}",
                            "max_tokens": 8, "temperature": 0, "stream": i % 2 == 0}
                    assert client.post("/v1/completions", json=body).status_code == 200
                for i in range(5):
                    body = {"model": MODEL, "prompt": f"sampled {i}", "max_tokens": 8}
                    assert client.post("/v1/completions", json=body).status_code == 200
            yield url


def _ended_pairs(url: str) -> int:
    pools = httpx.get(f"{url}/admin/canary/{MODEL}/disagreements", headers=AUTH).json()["pools"]
    return sum(p["compared"] + sum(p["dropped"].values()) for p in pools.values())


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "canary", "report", "--model", MODEL,
                           "--gateway", url, "--admin-token", TOKEN, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_like_engine_passes_and_one_with_other_text_fails_on_agreement(gateway: str) -> None:
    # every copy ended (35 requests, two shadow pools)
    wait_until(lambda: _ended_pairs(gateway) >= 70, 20,
               lambda: f"70 ended pairs, have {_ended_pairs(gateway)}", every=0.1)
    same = cli(gateway, "--canary", "same", "--json")
    result = json.loads(same.stdout)
    assert judged(result)["class"] == "pass" and judged(result)["canary_rate"] == 1.0
    assert judged(result)["pairs"]["greedy_compared"] == 30
    assert judged(result)["pairs"]["not_greedy"] == 5 and same.returncode == 0
    other = cli(gateway, "--canary", "other", "--json")
    result = json.loads(other.stdout)
    assert judged(result)["class"] == "fail" and judged(result)["canary_rate"] == 0.0
    assert judged(result)["critical"] and result["verdict"] == "fail" and other.returncode == 1
    assert result["agreement_reference"] is None
    # Against `same` as the reference: a drop of 100 points.
    drop = json.loads(cli(gateway, "--canary", "other", "--reference", "same", "--json").stdout)
    assert judged(drop)["reference"] == "same" and judged(drop)["change_points"] == -100.0
    assert judged(drop)["class"] == "fail"
    # The table.
    table = cli(gateway, "--canary", "other").stdout
    assert re.search(r"^agreement \* +floor 90\.0% +0\.0% +-90\.0p +\[-90\.0p, -7\d\.\dp\] +\S+ +"
                     r"fail$", table, re.M), table
    assert "30 compared, 5 not greedy (not judged), 0 dropped, 0 skipped" in table
    # The admin endpoint says the same as the CLI.
    admin = httpx.get(f"{gateway}/admin/canary/{MODEL}?canary=other", headers=AUTH).json()
    assert judged(admin)["class"] == "fail" and admin["verdict"] == "fail"


def test_the_guard_exports_the_judged_agreement(gateway: str) -> None:
    def gauges() -> dict[tuple[str, str, str], float]:
        out = {}
        for line in httpx.get(f"{gateway}/metrics").text.splitlines():
            if line.startswith("llm_gateway_canary_agreement_ratio{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:
                                                             line.index("}")].split(","))
                key = tuple(labels[k].strip('"') for k in ("canary", "metric", "bound"))
                out[key] = float(line.rsplit(" ", 1)[1])
        return out

    wait_until(lambda: gauges().get(("other", "agreement", "estimate")) == 0.0, 20, gauges,
               every=0.2)
    got = gauges()
    assert got[("same", "agreement", "estimate")] == 1.0
    assert got[("other", "agreement", "required")] == 0.9
    assert got[("other", "agreement", "high")] < 0.9 < got[("same", "agreement", "low")] + 0.1
    verdicts = httpx.get(f"{gateway}/metrics").text
    assert ('llm_gateway_canary_verdict{baseline="stable",canary="other",metric="agreement",'
            'model="sim-model"} 2.0') in verdicts
    assert ('llm_gateway_canary_verdict{baseline="stable",canary="same",metric="agreement",'
            'model="sim-model"} 0.0') in verdicts


def test_the_table_shows_too_few_pairs_as_insufficient() -> None:
    from gateway.canary.report import text

    result = {"model": MODEL, "baseline": "stable", "canary": "next", "window_s": 60.0,
              **verdict(requests(), requests(), CONFIG, pairs(3, 10))}
    table = text(result)
    assert re.search(r"^agreement \* +floor +10 +insufficient data \(pairs\)$", table, re.M), table
    ref = {"model": MODEL, "baseline": "stable", "canary": "next", "window_s": 60.0,
           **verdict(requests(), requests(), CONFIG, pairs(3, 10), pairs(8, 9), "self")}
    assert re.search(r"^agreement \* +9 +10 +insufficient data \(pairs\)$", text(ref), re.M)
