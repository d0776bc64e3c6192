"""The disaggregation benchmark's smallest fleets (one prefill and one decode replica against
two doing both) run to the end with the work where P/D puts it: every request completes,
every lease releases all it reserved, the prefill engine computes every prompt and answers one
token, the decode engine computes one prompt token per request and streams every output
token. Its figures are the benchmark's business; these are its mechanics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.disaggregation import (TRANSFER_MS_PER_BLOCK, WORKLOADS, Fleet, main,
                                       run_row, schedule)

N = 60


@pytest.fixture(scope="module")
def rows() -> tuple[list, dict, dict]:
    w = WORKLOADS["long-prompt"]
    requests, arrivals = schedule(w, N, seed=1, rate=0.5 * w.saturation / 2)  # half load
    return (requests, run_row(w, "2xboth", requests, arrivals),
            run_row(w, "1P+1D", requests, arrivals))


def test_every_request_completes_and_every_lease_is_released(rows) -> None:
    _, aggregated, disaggregated = rows
    for result in (aggregated, disaggregated):
        assert result["completed"] == N and result["ledger_left"] == {}
        assert None not in result["ttft_by_request_s"]
        assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]
        assert sum(r["requests"] for r in result["replicas"] if r["role"] != "prefill") == N


def test_prefill_runs_on_the_prefill_replica_and_the_decode_one_computes_one_token(rows) -> None:
    requests, aggregated, disaggregated = rows
    prompts, outputs = sum(r.prompt for r in requests), sum(r.output for r in requests)
    prefill, decode = disaggregated["replicas"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["requests"] == decode["requests"] == N
    assert prefill["prefill_tokens"] == prompts and prefill["generated"] == N  # 1 token each
    assert decode["preemptions"] == 0
    assert decode["prefill_tokens"] == N  # the last prompt token of each, nothing more
    assert decode["generated"] == outputs
    assert sum(r["prefill_tokens"] for r in aggregated["replicas"]) == prompts
    assert sum(r["generated"] for r in aggregated["replicas"]) == outputs
    # the KV crossed the link: at least a 2k-token prompt's 125 blocks, per request
    assert disaggregated["transfer_mean_ms"] >= 125 * TRANSFER_MS_PER_BLOCK


def test_decode_steps_without_prompt_chunks_keep_token_gaps_short(rows) -> None:
    """Aggregated, a 2k-8k prompt's chunk stretches the step every decode waits for; on the
    decode replica a step is decodes and one-token admissions only."""
    _, aggregated, disaggregated = rows
    assert disaggregated["itl_p99_ms"] < 15 < 60 < aggregated["itl_p99_ms"]
    assert disaggregated["tpot_p99_ms"] < aggregated["tpot_p99_ms"]


def test_fleet_names_parse_and_print_back() -> None:
    assert Fleet.parse("4xboth") == Fleet(0, 4)
    assert Fleet.parse("3P+1D@2048") == Fleet(3, 1, 2048)
    assert [Fleet.parse(n).name for n in ("4xboth@2048", "1P+3D")] == ["4xboth@2048", "1P+3D"]
    assert Fleet(1, 3).roles() == ["prefill", "decode", "decode", "decode"]
    with pytest.raises(ValueError):
        Fleet.parse("2P2D")


def test_the_driver_prints_a_table_with_paired_differences(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.json"
    assert main(["--replicas", "2", "--workloads", "long-output", "--requests", "30",
                 "--warmup", "0", "--seeds", "1", "2", "--loads", "0.3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table[1:]] == [
        "| 2xboth:least_outstanding_tokens", "| 2xboth:least_expected_work",
        "| 2xboth@2048:least_expected_work", "| 1P+1D:least_expected_work"]
    assert "(Δ" in table[-1] and "(Δ" not in table[2]  # the baseline row has no difference
    written = json.loads(out.read_text())
    assert {r["row"] for r in written["rows"]} >= {"1P+1D:least_expected_work"}
    assert all(run["completed"] == 30 for r in written["rows"] for run in r["runs"])
