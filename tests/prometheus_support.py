"""A real ``prometheus`` (Debian's package) scraping the test's gateway and engines with the
shipped ``deploy/prometheus.yml`` (targets and interval swapped for the test's)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator, Sequence

import yaml

from support import ROOT, free_port, stop, wait_ready

PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"


@contextlib.contextmanager
def prometheus(tmp: Path, gateways: str | Sequence[str],
               engines: Sequence[str] = ()) -> Iterator[str]:
    """The shipped scrape config with the test's targets (one gateway or several; the engines'
    job dropped when there are none), scraped every second; its base URL."""
    gateways = [gateways] if isinstance(gateways, str) else list(gateways)
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["llm-gateway"]["static_configs"] = [{"targets": [g.split("//")[1] for g in gateways]}]
    jobs["llm-engines"]["static_configs"] = [{"targets": [e.split("//")[1] for e in engines]}]
    if not engines:
        config["scrape_configs"] = [jobs["llm-gateway"]]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/-/ready", timeout=60, proc=proc)
        yield url
    finally:
        stop(proc, timeout=20)
