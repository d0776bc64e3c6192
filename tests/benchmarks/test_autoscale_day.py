"""The autoscaling benchmark's mechanics on a short day (benchmarks/autoscale_day.py): every
request is served or refused, every lease released; the static fleet never changes; the
gateway's signal grows the fleet for the peak and shrinks it after. Its figures are the
benchmark's business."""

from __future__ import annotations

import pytest

from benchmarks.autoscale_day import SCALERS, arrivals, run

HOUR = 120.0  # a 48-minute day
TROUGH = 2.0


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    requests = arrivals(1, HOUR, TROUGH)
    out = {}
    for name in SCALERS:
        for r in requests:
            r.ttft, r.refused = None, False
        out[name] = run(name, requests, HOUR, TROUGH, 30.0)
    return out


def test_every_request_is_served_or_refused_and_nothing_is_left(results) -> None:
    for name, result in results.items():
        assert result["served"] + result["refused"] == result["requests"], name
        assert result["in_flight_left"] == 0, name


def test_the_static_fleet_stays_and_the_gateway_signal_follows_the_day(results) -> None:
    static = results["static"]
    assert static["replicas_asked"] == static["replicas_left"]
    gateway = results["gateway"]
    # More replicas were asked for over the day than the peak-sized fleet holds at once
    # (up for the peak, down after, up again), and fewer GPU-seconds spent than it.
    assert gateway["replicas_asked"] > static["replicas_left"]
    assert gateway["replicas_left"] < static["replicas_left"]
    assert gateway["gpu_seconds"] < static["gpu_seconds"]
    assert gateway["interactive_met"] > 0.9
