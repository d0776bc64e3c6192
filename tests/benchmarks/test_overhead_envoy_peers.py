"""The overhead benchmark's Envoy peers: Envoy alone and Envoy + the endpoint picker differ
only by the picker, both configs are ones Envoy accepts, the null processor's peer carries
requests, and the picker's comparison table reads the same rounds for every ratio."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import (ENVOY, HOST, MODEL, NULL_PROCESSOR, PICKER, envoy_bootstrap,
                                peer_parts, peer_unavailable, replica_and_gateway)
from benchmarks.null_processor import SEEN
from benchmarks.overhead import SCENARIOS, picker_table


def filters(conf: dict) -> list[str]:
    listener = conf["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in manager["http_filters"]]


def test_envoy_alone_is_the_pickers_bootstrap_without_the_picker() -> None:
    alone = envoy_bootstrap(8000, 9000, 9901)
    picked = envoy_bootstrap(8000, 9000, 9901, picker=f"{HOST}:9002")
    for conf in (alone, picked):  # loopback only, in front of the one replica
        listener = conf["static_resources"]["listeners"][0]
        assert listener["address"]["socket_address"] == {"address": HOST, "port_value": 8000}
        replicas = conf["static_resources"]["clusters"][0]
        assert replicas["load_assignment"]["endpoints"][0]["lb_endpoints"] == [
            {"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": 9000}}}}]
    assert filters(alone) == ["envoy.filters.http.router"]
    assert filters(picked) == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert [c["name"] for c in alone["static_resources"]["clusters"]] == ["replicas"]
    picker = picked["static_resources"]["clusters"][1]
    assert picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"] == {
        "address": {"socket_address": {"address": HOST, "port_value": 9002}}}
    assert alone["static_resources"]["clusters"][0]["lb_policy"] == "LEAST_REQUEST"
    # everything else the same: listener, route, retries, timeouts
    strip = json.loads(json.dumps(picked))
    manager = strip["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    manager["typed_config"]["http_filters"].pop(0)
    assert strip["static_resources"]["listeners"] == alone["static_resources"]["listeners"]


@pytest.mark.skipif(peer_unavailable("envoy") is not None, reason="no Envoy binary")
@pytest.mark.parametrize("picker", [None, f"{HOST}:9002"])
def test_envoy_accepts_both_bootstraps(picker: str | None, tmp_path: Path) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(envoy_bootstrap(8000, 9000, 9901, picker)))
    done = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path),
                           "--disable-hot-restart", "--log-level", "warning"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_picker_table_gives_both_ratios_round_by_round() -> None:
    def figures(rounds: list[float], p50: float, picker: list[float] | None = None) -> dict:
        out = {"router_cpu_us_per_request": sum(rounds) / len(rounds),
               "round_cpu_us_per_request": rounds, "latency_ms": {"p50": p50}}
        if picker is not None:
            out["parts"] = {PICKER: {"cpu_us_per_request": sum(picker) / len(picker)}}
        return out

    sc = next(s for s in SCENARIOS if not s.stream)
    res = {sc.key: {"scenario": sc.__dict__,
                    "order": ["direct", "gateway", "envoy", "envoy-epp"],
                    "direct": {"latency_ms": {"p50": 1.0}},
                    "gateway": figures([100.0, 150.0], 2.0),
                    "envoy": figures([40.0, 50.0], 1.5),
                    "envoy-epp": figures([200.0, 150.0], 3.0, picker=[120.0, 80.0])}}
    row = [c.strip() for c in picker_table(res).splitlines()[2].split("|")[1:-1]]
    assert row == [sc.what, "45.0 / 175.0 (100.0) / 125.0", "3.89 (5.00, 3.00)",
                   "1.40 (2.00, 1.00)", "1.000 / 1.500 / 3.000 / 2.000"]


@pytest.mark.skipif(peer_unavailable("envoy-null") is not None, reason="no Envoy binary")
def test_the_null_processors_peer_carries_requests_and_charges_its_processor() -> None:
    with replica_and_gateway("--profile instant", peers=("envoy-null",)) as (ports, _, tmp):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        through = httpx.post(f"http://{HOST}:{ports['envoy-null']}/v1/completions", json=body,
                             timeout=10)
        direct = httpx.post(f"http://{HOST}:{ports['direct']}/v1/completions", json=body,
                            timeout=10)
        assert through.status_code == direct.status_code == 200
        assert through.json()["choices"] == direct.json()["choices"]
        assert through.headers[SEEN] == "1"  # Envoy asked the processor
        processor = peer_parts("envoy-null", tmp)[NULL_PROCESSOR]
        assert "benchmarks.null_processor" in Path(f"/proc/{processor}/cmdline").read_text()
