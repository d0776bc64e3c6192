"""Every development benchmark driver in benchmarks/ runs end to end on a tiny budget and
writes its results (figures are the benchmarks' business, not these tests'): a driver that
no longer starts, or no longer writes what its docs say, fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

# driver -> arguments for a run of a few seconds, writing JSON to {out}
SMOKE = {
    "shared_state": ["--requests", "40", "--rounds", "1", "--cost-seconds", "0.5",
                     "--out", "{dir}"],
    "access_cost": ["--duration", "0.5", "--rounds", "1", "--admissions", "200",
                    "--out", "{out}"],
    "fairness": ["--seconds", "1", "--out", "{out}"],
    "shadow": ["--seconds", "0.5", "--rounds", "1", "--users", "2", "--out", "{out}"],
    "metrics_cost": ["--duration", "0.5", "--rounds", "1", "--out", "{out}"],
    "tracing_cost": ["--duration", "0.5", "--rounds", "1", "--out", "{out}"],
    "tracing_cost --hooks": ["--hooks", "50", "--out", "{out}"],
    "saturation": ["--seconds", "1", "--rounds", "1", "--connections", "8", "--out", "{out}"],
    "loop_stall": ["--replicas", "2", "--rounds", "1", "--streams", "2", "--out", "{out}"],
    "token_cache_cost": ["--rounds", "1", "--requests", "2", "--tokens", "600", "--cached",
                         "400", "--out", "{out}"],
    "autoscale_day": ["--seeds", "1", "--hour-seconds", "30", "--trough", "1",
                      "--out", "{out}"],
}


@pytest.mark.parametrize("driver", list(SMOKE))
def test_driver_runs_and_writes_its_results(driver: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = [a.format(out=out, dir=tmp_path) for a in SMOKE[driver]]
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{driver.split()[0]}", *args],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = [out] if out.exists() else sorted(tmp_path.glob("*.json"))
    assert written, f"{driver} wrote no JSON: {done.stdout[-2000:]}"
    assert json.loads(written[0].read_text())
