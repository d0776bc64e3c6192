"""The KV events cost driver runs end to end on a tiny budget and prints every row of its
table with positive figures (the figures themselves are the benchmark's business)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from support import ROOT

EVENT_ROWS = ["decode, 16-token blocks", "apply, 16-token blocks",
              "decode + apply, 16-token blocks", "decode, 32-token blocks",
              "apply, 32-token blocks", "decode + apply, 32-token blocks",
              "ZMQ PUB -> EventSubscriber, 16-token blocks",
              "ZMQ PUB -> EventSubscriber, 32-token blocks"]
REQUEST_ROWS = ["render the chat template", "one-token-per-byte bound",
                "tokenize: ModelTokenizer.encode", "tokenize: encode_batch_fast", "PromptKeys.keys(16)", "PromptKeys.keys(32)",
                "matched, 8 replicas (1 full", "matched, 8 replicas all", "note_sent",
                "**added per request**", "added / 173 µs", "added / 90 µs"]


def test_kv_events_cost_prints_every_row_with_positive_figures(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kv_events_cost", "--rounds", "2", "--batches", "60",
         "--scale", "0.005", "--index-blocks", "500", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| per ")}
    for name in EVENT_ROWS + REQUEST_ROWS:
        matching = [line for label, line in rows.items() if label.startswith(name)]
        assert len(matching) == 1, (name, done.stdout)
        figures = [float(f.replace(",", "")) for cell in matching[0].split("|")[2:]
                   for f in re.findall(r"[\d,]+\.?\d*", cell)]
        assert figures and all(f > 0 for f in figures), matching[0]
    assert "nproc" in done.stdout and "load average" in done.stdout
    res = json.loads(out.read_text())
    assert len(res["requests"]) == 3 and len(res["zmq"]) == 2
