"""The flow-control benchmark's mechanics on a small schedule past saturation: every request
that was not shed completes and every lease is released; only the sheddable kind is shed and
only by the flow rows; the flow rows hold requests at the gateway and keep the engines' own
queues shorter than the rows that send at once. Its figures are the benchmark's business."""

from __future__ import annotations

import pytest

from benchmarks.flow_control import ROWS, run_row, saturation, workload

N = 400


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    requests, arrivals = workload(N, 2.0 * saturation(n=400), seed=1)
    return {row: run_row(row, requests, arrivals) for row in ROWS}


def test_every_request_not_shed_completes_and_every_lease_is_released(results) -> None:
    for result in results.values():
        assert result["completed"] + sum(result["shed_by_kind"].values()) == N
        assert result["ledger_left"] == {}
        assert result["batch_completed"] == 1.0


def test_only_the_sheddable_kind_is_shed_and_only_by_flow_control(results) -> None:
    for row, result in results.items():
        shed = result["shed_by_kind"]
        assert shed["interactive"] == shed["batch"] == 0
        assert (shed["eval"] > 0) == row.startswith("priority")
        assert (result["held"] > 0) == row.startswith("priority")


def test_flow_control_keeps_the_queue_at_the_gateway(results) -> None:
    held = max(results["priority"]["engine_queue_max"],
               results["priority+objectives"]["engine_queue_max"])
    assert held < results["today"]["engine_queue_max"]
    assert results["priority+objectives"]["error_p50"] is not None  # the model was fitted
