"""The scheduling benchmark's pure parts: seeded schedules shaped as the issue says, row specs,
and the target check (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import random

from benchmarks.scheduling import (BURST_PERIOD, PREFIX_TOKENS, WORKLOADS, _row_settings,
                                      check_targets, combine_seeds, compare_to_default,
                                      markdown, schedule)
from benchmarks.scheduling_virtual import run_row as run_virtual


def test_schedules_are_seeded_and_shaped_like_the_workloads() -> None:
    w1, w2, w3 = (WORKLOADS[n] for n in ("W1", "W2", "W3"))
    requests, arrivals = schedule(w1, 400, seed=3)
    again, arrivals_again = schedule(w1, 400, seed=3)
    assert [r.prompt for r in requests] == [r.prompt for r in again] and arrivals == arrivals_again
    assert schedule(w1, 400, seed=4)[1] != arrivals
    long = [r for r in requests if r.tag == "long"]
    assert 0.08 < len(long) / len(requests) < 0.22
    rate = len(arrivals) / arrivals[-1]
    assert 0.6 * w1.saturation < rate < w1.saturation

    requests, _ = schedule(w2, 300, seed=3)
    prefixes = {r.prompt[:2000] for r in requests}  # 16 system prompts at most, ~8 KB each
    assert 4 <= len(prefixes) <= 16
    assert all(r.tag.startswith("prefix") for r in requests)
    assert len(requests[0].prompt) > PREFIX_TOKENS  # a prefix of 2,000 tokens + the user part

    _, arrivals = schedule(w3, 1000, seed=3)
    calm = [a for a in arrivals if int(a // BURST_PERIOD) % 2 == 0]
    burst = [a for a in arrivals if int(a // BURST_PERIOD) % 2 == 1]
    assert len(burst) > 1.6 * len(calm)  # 110% vs 50% of saturation


def test_row_specs_carry_scheduling_weights() -> None:
    assert _row_settings("least_expected_work") == ("least_expected_work", {})
    assert _row_settings("least_expected_work:prefix_weight=0,signals_weight=0.5") == (
        "least_expected_work", {"prefix_weight": 0.0, "signals_weight": 0.5})


def row(name: str, p99: float, tokens: float = 100.0, per_replica=(25, 25, 25, 25)) -> dict:
    return {"row": name, "ttft_p99_s": p99, "output_tokens_per_s": tokens,
            "requests_per_replica": list(per_replica)}


def test_targets_are_checked_against_contenders_only() -> None:
    rows = [row("round_robin", 1.0), row("least_outstanding_tokens", 0.5),
            row("least_expected_work", 0.52), row("least_expected_work:prefix_weight=0", 0.1),
            {"row": "vllm-router cache_aware", "unavailable": "not installed"}]
    lines = check_targets("W1", rows)
    assert lines[0].startswith("FAIL W1: lowest TTFT p99")  # 0.52 > 0.5; the ablation ignored
    assert any(l.startswith("PASS W1: within 10%") for l in lines)
    starving = [row("least_expected_work", 0.2, per_replica=(60, 20, 10, 10)),
                row("sglang-router cache_aware", 0.3)]
    lines = check_targets("W2", starving)
    assert any(l.startswith("FAIL W2: every replica") for l in lines)
    assert any(l.startswith("PASS W2: at least as good") for l in lines)


def test_seeds_combine_into_means_with_each_seed_kept() -> None:
    def run(p99: float, tokens: float, per_replica: list[int]) -> dict:
        return {"row": "x", "requests": 4, "ok": 4, "errors": {"http_429": 1}, "ttft_p50_s": 0.1,
                "ttft_p99_s": p99, "ttft_p99_long_s": None, "output_tokens_per_s": tokens,
                "requests_per_replica": per_replica, "prefix_cache_hit_rate": 0.5}
    combined = combine_seeds("x", {1: run(1.0, 100.0, [1, 3]), 2: run(3.0, 200.0, [2, 2])})
    assert combined["ttft_p99_s"] == 2.0 and combined["output_tokens_per_s"] == 150.0
    assert combined["ttft_p99_s_by_seed"] == {1: 1.0, 2: 3.0}
    assert combined["requests_per_replica"] == [3, 5] and combined["errors"] == {"http_429": 2}
    assert combined["ttft_p99_long_s"] is None
    failed = combine_seeds("x", {1: run(1.0, 1.0, [1]), 2: {"row": "x", "unavailable": "boom"}})
    assert failed["unavailable"] == "boom"


def test_virtual_time_runs_the_real_policies_deterministically() -> None:
    """The tuning harness: same inputs, same figures; prefix affinity shows in the hit rate."""
    w2 = WORKLOADS["W2"]
    requests, arrivals = schedule(w2, 300, seed=5)
    ours = run_virtual(w2, "least_expected_work", requests, arrivals)
    assert ours == run_virtual(w2, "least_expected_work", requests, arrivals)
    blind = run_virtual(w2, "least_expected_work:prefix_weight=0", requests, arrivals)
    assert ours["prefix_cache_hit_rate"] > blind["prefix_cache_hit_rate"] + 0.05
    assert sum(ours["requests_per_replica"]) == 300
    assert ours["ttft_p50_s"] > 0 and ours["output_tokens_per_s"] > 0


def test_virtual_time_engine_signals_see_traffic_the_ledger_does_not() -> None:
    """Another client sends a fifth of the load straight to the first replica: with engine
    signals the gateway sends it less of its own than without."""
    w1 = WORKLOADS["W1"]
    requests, arrivals = schedule(w1, 400, seed=2)
    seen = run_virtual(w1, "least_expected_work", requests, arrivals, direct_share=0.2)
    blind = run_virtual(w1, "least_expected_work:signals_weight=0", requests, arrivals,
                        direct_share=0.2)
    assert sum(seen["requests_per_replica"]) == sum(blind["requests_per_replica"]) < 400
    assert seen["requests_per_replica"][0] < 0.5 * blind["requests_per_replica"][0]


def test_each_timing_model_has_its_measured_saturation() -> None:
    """TIMING_MODELS holds what --saturation measures (round robin, the whole mix at once),
    and a workload moved to a faster profile keeps its wall-clock request rate."""
    from benchmarks.scheduling import DEFAULT_PROFILE, TIMING_MODELS
    from benchmarks.scheduling_virtual import saturation
    for profile, rates in TIMING_MODELS.items():
        w1 = WORKLOADS["W1"].on(profile)
        assert w1.profile == profile and w1.saturation == rates["W1"]
        assert abs(saturation(w1) - rates["W1"]) < 0.05 * rates["W1"], profile
        base = WORKLOADS["W1"].on(DEFAULT_PROFILE)
        assert abs(w1.saturation * w1.speed - base.saturation * base.speed) < 1e-9
    w4 = WORKLOADS["W4"].on("llama3-8b-h100-vllm-v1")
    assert abs(saturation(w4) - w4.saturation) < 0.05 * w4.saturation
    fast = WORKLOADS["W1"].on("llama3-8b-h100-kvpoor")
    assert fast.saturation > 1.5 * WORKLOADS["W1"].saturation


def test_over_asking_clients_reserve_more_than_they_get_and_the_oracle_does_not() -> None:
    """--asked: every client asks for 1,024 tokens; the engines stop at the workload's
    lengths whichever way the ledger reserves."""
    w1 = WORKLOADS["W1"]
    requests, arrivals = schedule(w1, 300, seed=4)
    exact = run_virtual(w1, "least_outstanding_tokens", requests, arrivals)
    asked = run_virtual(w1, "least_outstanding_tokens", requests, arrivals, asked=(1024,))
    oracle = run_virtual(w1, "least_outstanding_tokens@exact", requests, arrivals,
                         asked=(256, 4096))
    assert oracle == {**exact, "row": "least_outstanding_tokens"}
    assert asked["requests_per_replica"] != exact["requests_per_replica"]  # other choices


def test_late_binding_holds_requests_in_the_gateway_and_counts_their_wait() -> None:
    """A per-replica limit (or a full KV) keeps requests in the gateway's queue; every one
    is still served, and its TTFT runs from when the client sent it."""
    w1 = WORKLOADS["W1"]
    requests, arrivals = schedule(w1, 300, seed=6)
    free = run_virtual(w1, "least_expected_work", requests, arrivals)
    capped = run_virtual(w1, "least_expected_work", requests, arrivals, max_in_flight=2)
    assert sum(capped["requests_per_replica"]) == 300
    assert capped["ttft_p50_s"] > 2 * free["ttft_p50_s"]  # 2 in flight cannot keep up
    tight = run_virtual(w1, "least_expected_work", requests, arrivals, kv_binding=1e-3)
    assert sum(tight["requests_per_replica"]) == 300  # an idle replica always takes one
    assert tight["ttft_p50_s"] > free["ttft_p50_s"]


def test_the_virtual_benchmark_command_runs_every_option(capsys) -> None:
    from benchmarks.scheduling_virtual import main
    assert main(["--workloads", "W1", "--requests", "60", "--rows", "least_expected_work",
                 "least_expected_work@exact", "--profiles", "llama3-8b-h100-kvpoor",
                 "--asked", "256,1024", "--direct-share", "0.1", "--max-in-flight", "8",
                 "--kv-binding", "1.0", "--compare", "round_robin"]) == 0
    out = capsys.readouterr().out
    assert "on llama3-8b-h100-kvpoor" in out and "least_expected_work@exact" in out
    assert out.count("p99 minus round_robin's") == 2


def test_the_p99_difference_is_paired_and_its_interval_covers_what_chance_allows() -> None:
    """Rows that give every request the same TTFT differ by exactly 0; a row slower by 0.5 s
    on every request is 0.5 s worse with no doubt; noise alone gives an interval around 0."""
    from benchmarks.stats import p99_difference, top_percentile
    from gateway.bench.report import percentile
    rng = random.Random(3)
    seeds = [[rng.expovariate(10) for _ in range(1000)] for _ in range(2)]
    for q in (99, 99.9, 100):
        assert top_percentile(seeds[0], q) == percentile(sorted(seeds[0]), q)
    assert p99_difference(seeds, seeds) == (0.0, 0.0, 0.0)
    slower = [[t + 0.5 for t in seed] for seed in seeds]
    diff, low, high = p99_difference(slower, seeds)
    assert abs(diff - 0.5) < 1e-9 and abs(low - 0.5) < 1e-9 and abs(high - 0.5) < 1e-9
    other = [[rng.expovariate(10) for _ in range(1000)] for _ in range(2)]  # same law
    diff, low, high = p99_difference(other, seeds)
    assert low < diff < high and low < 0 < high
    with_direct = [[None, *seed[1:]] for seed in seeds]  # a request the gateway never placed
    assert p99_difference(with_direct, slower)[0] < 0


def test_learned_output_lengths_undo_the_noise_of_arbitrary_asks() -> None:
    """Clients asking 256, 1,024 or 4,096 tokens at random for the same answers: reserving
    the asks raises W2's TTFT p99 by 70-150% (virtual time, seeds 1 and 2); reserving what
    completed requests used brings it back to the oracle's (that knows each length)."""
    w2 = WORKLOADS["W2"]
    for seed in (1, 2):
        requests, arrivals = schedule(w2, 1000, seed=seed)
        learned, asked, exact = (
            run_virtual(w2, row, requests, arrivals, asked=(256, 1024, 4096))["ttft_p99_s"]
            for row in ("least_expected_work", "least_expected_work@asked",
                        "least_expected_work@exact"))
        assert learned < 0.6 * asked and learned < 1.1 * exact, (seed, learned, asked, exact)


def test_wall_clock_rows_are_compared_with_the_default_request_by_request() -> None:
    """Every row but the default gets its p99 minus the default's with an interval, in the
    JSON and in the markdown table; unavailable rows are left alone."""
    rng = random.Random(5)

    def row(name: str, shift: float) -> dict:
        by_seed = {seed: {"ttft_by_request_s": [rng.expovariate(20) + shift
                                                 for _ in range(400)], "ttft_p99_s": 0.3}
                   for seed in (1, 2)}
        return {"row": name, "ttft_p50_s": 0.05, "ttft_p99_s": 0.3, "errors": {},
                "ttft_p99_s_by_seed": {1: 0.3, 2: 0.3}, "output_tokens_per_s": 100.0,
                "requests_per_replica": [100, 100], "prefix_cache_hit_rate": None,
                "by_seed": by_seed}

    rows = [row("least_expected_work", 0.0), row("round_robin", 1.0),
            {"row": "vllm-router power_of_two", "unavailable": "not installed"}]
    compare_to_default(rows)
    assert "p99_minus_default_s" not in rows[0] and "p99_minus_default_s" not in rows[2]
    diff, low, high = rows[1]["p99_minus_default_s"]
    assert 0.5 < low <= diff <= high  # a second slower on every request: beyond chance
    table = markdown({"profile": "llama3-8b-a100", "workloads": {"W1": {
        "requests": 400, "seeds": [1, 2], "mean_rate": 30.0, "rows": rows, "targets": []}}})
    assert f"| {diff:+.3f} ({low:+.3f} .. {high:+.3f}) |" in table


def test_w4_is_tenants_with_long_prefixes_and_a_ramping_load() -> None:
    """W4 (llm-d's shape): each request is one of 75 tenants' 6,000-token prefixes and a short
    question of its own; the prefixes need more KV than one replica has, less than the
    fleet's; the arrival rate ramps from 20% to 150% of saturation."""
    from benchmarks.scheduling import REPLICAS, TENANT_PREFIX_TOKENS, TENANTS
    w4 = WORKLOADS["W4"].on("llama3-8b-h100-vllm-v1")
    requests, arrivals = schedule(w4, 600, seed=2)
    assert schedule(w4, 600, seed=2)[1] == arrivals
    assert all(r.tag.startswith("tenant") for r in requests)
    assert len({r.tag for r in requests}) > 0.8 * TENANTS
    by_tenant = {r.tag: r.prompt for r in requests}
    first = requests[0]
    assert first.prompt.startswith(by_tenant[first.tag][:TENANT_PREFIX_TOKENS])
    assert TENANTS * TENANT_PREFIX_TOKENS > w4.kv_capacity_tokens  # not one replica's
    assert TENANTS * TENANT_PREFIX_TOKENS < 0.5 * REPLICAS * w4.kv_capacity_tokens  # the fleet's
    early = 100 / arrivals[99]
    late = 100 / (arrivals[-1] - arrivals[-101])
    assert early < 0.5 * w4.saturation and late > 1.1 * w4.saturation


def test_the_events_row_routes_on_the_engines_kv_events() -> None:
    """@events: the V1 engines announce their blocks, each replica's index is live and holds
    them, the engines see more prefix hits than with the approximate index, and the
    requests are spread (every replica at least 80% of its fair share)."""
    w4 = WORKLOADS["W4"].on("llama3-8b-h100-vllm-v1")
    requests, arrivals = schedule(w4, 240, seed=1)
    precise = run_virtual(w4, "least_expected_work@events", requests, arrivals)
    assert precise == run_virtual(w4, "least_expected_work@events", requests, arrivals)
    approximate = run_virtual(w4, "least_expected_work", requests, arrivals)
    assert precise["row"] == "least_expected_work@events" and approximate["kv_index"] is None
    assert all(i["live"] and i["blocks"] > 0 and i["orphans"] == 0
               for i in precise["kv_index"])
    assert precise["prefix_cache_hit_rate"] > approximate["prefix_cache_hit_rate"]
    # what the index predicted is what the engines found (the events say what they hold)
    predicted = sum(i["predicted_hit"] for i in precise["kv_index"]) / 4
    assert abs(predicted - precise["prefix_cache_hit_rate"]) < 0.1
    assert min(precise["requests_per_replica"]) >= 0.8 * 240 / 4
    assert sum(precise["requests_per_replica"]) == 240


def test_the_events_row_needs_the_v1_timing_model() -> None:
    import pytest
    from benchmarks.scheduling_virtual import main
    w2 = WORKLOADS["W2"]  # on the A100 profile: no KV events
    requests, arrivals = schedule(w2, 20, seed=1)
    with pytest.raises(ValueError, match="vLLM V1 timing model"):
        run_virtual(w2, "least_expected_work@events", requests, arrivals)
    with pytest.raises(SystemExit):
        main(["--workloads", "W2", "--rows", "least_expected_work@events"])
    with pytest.raises(ValueError, match="flags"):
        run_virtual(w2, "least_expected_work@eventz", requests, arrivals)


def test_wall_clock_events_rows_need_the_v1_model_and_a_publishing_sim(tmp_path) -> None:
    import pytest
    from benchmarks.scheduling import events_row, unavailable
    assert events_row("least_expected_work:prefix_weight=2@events") == (
        "least_expected_work:prefix_weight=2", True)
    assert events_row("round_robin") == ("round_robin", False)
    with pytest.raises(ValueError):
        events_row("least_expected_work@asked")
    assert "vLLM V1" in unavailable("least_expected_work@events", tmp_path, "llama3-8b-a100")
    assert unavailable("least_expected_work@events", tmp_path, "llama3-8b-h100-vllm-v1") is None
