"""The quick-start demo works end to end on embedded defaults."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import ROOT, free_port


def test_demo_serves_and_shows_the_four_examples() -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "gateway", "demo", "--duration", "1",
                          "--port", str(port), "--profile", "instant"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"gateway on http://127.0.0.1:{port}" in out.stdout
    assert '"object":"chat.completion"' in out.stdout  # the OpenAI example answered
    assert '"generated_text":"' in out.stdout  # the TGI stream reached its final event
    assert '"type":"message"' in out.stdout  # the Anthropic example answered
    assert '"code":"context_length_exceeded"' in out.stdout  # the too-long prompt got its 400


def test_demo_with_kv_events_routes_on_the_simulated_engines_events() -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "gateway", "demo", "--duration", "4",
                          "--port", str(port), "--kv-events"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "llama3-8b-h100-vllm-v1" in out.stdout  # the V1 model, whose pool publishes
    assert "KV events from tcp://127.0.0.1:" in out.stderr  # the gateway subscribed
    refused = subprocess.run([sys.executable, "-m", "gateway", "demo", "--duration", "1",
                              "--port", str(port), "--kv-events", "--profile", "instant"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs a vllm-v1 --profile" in refused.stderr


def test_demo_behind_envoy_answers_through_envoy_and_the_picker() -> None:
    """The second quick-start command (make demo-envoy): the same examples through Envoy,
    the gateway as its endpoint picker."""
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "gateway", "demo", "--envoy", "--duration", "1",
                          "--port", str(port), "--profile", "instant"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Envoy on http://127.0.0.1:{port}, the gateway as its endpoint picker" in out.stdout
    assert '"object":"chat.completion"' in out.stdout
    assert '"generated_text":"' in out.stdout  # TGI's stream, on the TGI replica as it is
    assert '"type":"message"' in out.stdout  # Anthropic's, passed through to a vLLM replica
    assert '"code":"context_length_exceeded"' in out.stdout  # the picker's own 400
    assert "endpoint picker (ext_proc) listening" in out.stderr


def _live(pgid: int) -> list[str]:
    """The processes of a process group that still run (a zombie has exited already)."""
    out = subprocess.run(["ps", "-e", "-o", "pgid=,stat=,args="], capture_output=True,
                         text=True, check=True).stdout
    return [line.strip() for line in out.splitlines()
            if int(line.split()[0]) == pgid and not line.split()[1].startswith("Z")]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _stream_until_cut(url: str, started: threading.Event) -> None:
    """A long completion stream, held open until the demo stops under it."""
    body = {"model": "demo-llama-3-8b", "prompt": "Hello", "max_tokens": 4000, "stream": True}
    with contextlib.suppress(httpx.HTTPError), \
            httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
        for _ in response.iter_bytes():
            started.set()


@pytest.mark.parametrize("envoy", [False, True], ids=["gateway", "envoy"])
@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c, SIGINT ignored", "SIGINT", "SIGTERM"])
def test_demo_stops_on_ctrl_c_every_process_within_5_s(envoy: bool, how: str,
                                                      tmp_path: Path) -> None:
    """Ctrl-C is SIGINT to the terminal's foreground process group: the demo and its replicas
    (and Envoy) at once. Started as a non-interactive shell starts a background job (SIGINT
    ignored, which Python then leaves ignored) the replicas died and the gateway served on
    (issue 48). SIGINT or SIGTERM to the demo alone stops them all too; a stream still open
    (on the default profile, seconds long) does not hold any of them up."""
    port = free_port()
    demo = [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--no-examples",
            *(["--envoy"] if envoy else [])]
    if how == "ctrl-c, SIGINT ignored":
        demo = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *demo]
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(demo, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr,
                                text=True, start_new_session=True)
    streaming = threading.Event()
    client = threading.Thread(target=_stream_until_cut, args=(f"http://127.0.0.1:{port}",
                                                              streaming))
    try:
        shown = ""
        for line in proc.stdout:  # type: ignore[union-attr]
            shown += line
            if "Ctrl-C to stop." in line:
                break
        assert "Ctrl-C to stop." in shown, (tmp_path / "stderr").read_text()[-2000:]
        ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", shown)]
        assert len(_live(proc.pid)) == 5 + envoy and all(_listening(p) for p in ports)
        client.start()
        assert streaming.wait(10)
        started = time.monotonic()
        if how.startswith("ctrl-c"):
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT if how == "SIGINT" else signal.SIGTERM)
        while _live(proc.pid) and time.monotonic() - started < 5:
            proc.poll()  # reaps the demo itself
            time.sleep(0.05)
        assert not _live(proc.pid), f"{how}: still running after 5 s: {_live(proc.pid)}"
        print(f"{how}: every process gone in {time.monotonic() - started:.2f} s")
        assert not [p for p in ports if _listening(p)]
    finally:
        if _live(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if client.is_alive():
            client.join()
