"""The canary verdict's statistics and scoring, as pure functions on generated samples."""

from __future__ import annotations

import random
import time

import pytest
from scipy import stats as scipy_stats

from gateway.canary.verdict import verdict
from gateway.canary.samples import Sample, SampleBook
from gateway.canary.stats import mann_whitney, median_change, two_proportions
from gateway.canary.config import CanaryJudgeConfig


@pytest.mark.parametrize("seed", range(5))
def test_mann_whitney_matches_scipy(seed: int) -> None:
    rng = random.Random(seed)
    a = [round(rng.lognormvariate(0, 0.5), 2) for _ in range(rng.randint(20, 200))]  # ties
    b = [round(rng.lognormvariate(0.1 * seed, 0.5), 2) for _ in range(rng.randint(20, 200))]
    u, p = mann_whitney(a, b)
    expected = scipy_stats.mannwhitneyu(b, a, alternative="two-sided", method="asymptotic",
                                        use_continuity=True)
    assert u == pytest.approx(expected.statistic)
    assert p == pytest.approx(expected.pvalue, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("counts", [(3, 300, 18, 300), (0, 50, 5, 60), (10, 100, 10, 100)])
def test_two_proportions_matches_the_z_test(counts: tuple[int, int, int, int]) -> None:
    e_a, n_a, e_b, n_b = counts
    pooled = (e_a + e_b) / (n_a + n_b)
    z = (e_b / n_b - e_a / n_a) / (pooled * (1 - pooled) * (1 / n_a + 1 / n_b)) ** 0.5
    assert two_proportions(*counts) == pytest.approx(2 * scipy_stats.norm.sf(abs(z)))


def test_median_change_interval_holds_the_truth() -> None:
    rng = random.Random(7)
    a = [rng.lognormvariate(0, 0.3) for _ in range(400)]
    b = [1.3 * rng.lognormvariate(0, 0.3) for _ in range(400)]
    change, low, high = median_change(a, b)
    assert low < 0.3 < high and low < change < high


def samples(rng: random.Random, n: int, ttft: float = 0.05, error_rate: float = 0.0,
            slowdown: float = 1.0) -> list[Sample]:
    now = time.time()
    out = []
    for _ in range(n):
        if rng.random() < error_rate:
            out.append(Sample(now, True, None, None, None, None))
            continue
        first = slowdown * ttft * rng.lognormvariate(0, 0.25)
        itl = slowdown * 0.01 * rng.lognormvariate(0, 0.1)
        out.append(Sample(now, False, first, itl, first + 63 * itl, 1 / itl))
    return out


CONFIG = CanaryJudgeConfig(min_samples=50)


def classes(result: dict) -> dict[str, str]:
    return {m["metric"]: m["class"] for m in result["metrics"]}


def test_a_30_percent_slower_canary_fails_on_ttft() -> None:
    rng = random.Random(1)
    result = verdict(samples(rng, 300), samples(rng, 300, slowdown=1.3), CONFIG)
    assert result["verdict"] == "fail" and classes(result)["ttft"] == "fail"
    assert classes(result)["tokens_per_s"] == "fail"  # slower tokens too


def test_five_points_more_errors_fail_the_canary() -> None:
    rng = random.Random(2)
    result = verdict(samples(rng, 600, error_rate=0.01), samples(rng, 600, error_rate=0.06),
                     CONFIG)
    assert result["verdict"] == "fail" and classes(result)["error_rate"] == "fail"
    assert classes(result)["ttft"] == "pass"


def test_identical_pools_never_fail_over_many_seeds() -> None:
    """No false fail at the configured significance: 40 pairs of same-distribution pools."""
    verdicts = [verdict(samples(random.Random(s), 200), samples(random.Random(s + 1000), 200),
                        CONFIG)["verdict"] for s in range(40)]
    assert verdicts.count("fail") == 0 and verdicts.count("pass") >= 36, verdicts


def test_a_significant_change_within_the_threshold_passes() -> None:
    """5,000 requests a side make a 1% slowdown significant; 1% is within 10%: a pass (CI
    judged identical pools marginal when significance alone made a metric marginal)."""
    rng = random.Random(5)
    result = verdict(samples(rng, 5000), samples(rng, 5000, slowdown=1.01), CONFIG)
    itl = next(m for m in result["metrics"] if m["metric"] == "itl")
    assert itl["p_value"] < 0.05 and 0 < itl["change"] < 0.1, itl
    assert set(classes(result).values()) == {"pass"} and result["verdict"] == "pass"


def test_a_large_change_not_yet_significant_is_marginal() -> None:
    """TTFTs spread over two orders of magnitude: 15% slower moves the median past the
    threshold, but 60 requests a side cannot tell it from chance."""
    now = time.time()

    def pool(scale: float) -> list[Sample]:
        return [Sample(now, False, scale * 0.01 * 1.08 ** i, 0.01, 1.0, 100.0) for i in range(60)]

    result = verdict(pool(1.0), pool(1.15), CONFIG)
    ttft = next(m for m in result["metrics"] if m["metric"] == "ttft")
    assert ttft["p_value"] >= 0.05 and ttft["change"] > 0.1, ttft
    assert ttft["class"] == "marginal" and classes(result)["itl"] == "pass"


def test_too_few_requests_is_insufficient_data_never_a_pass() -> None:
    rng = random.Random(3)
    for n in (0, 10, 49):
        result = verdict(samples(rng, 300), samples(rng, n), CONFIG)
        assert result["verdict"] == "insufficient data" and result["score"] is None


def test_a_non_critical_failure_lowers_the_score_only() -> None:
    config = CanaryJudgeConfig(min_samples=50, critical=["error_rate"])
    rng = random.Random(4)
    result = verdict(samples(rng, 300), samples(rng, 300, slowdown=1.3), config)
    # ttft, itl, e2e, tokens/s fail (not critical), errors pass: score 20 -> fail by score
    assert result["score"] == 20.0 and result["verdict"] == "fail"


def test_sample_book_is_bounded_and_windowed() -> None:
    book = SampleBook(per_pool=10)
    for i in range(25):
        book.record("m", "canary", Sample(1000.0 + i, False, 0.1, None, 0.2, None))
    assert len(book.window("m", "canary", 0)) == 10
    assert [s.at for s in book.window("m", "canary", 1020.0)] == [1020.0 + i for i in range(5)]
    assert book.window("m", "stable", 0) == []
