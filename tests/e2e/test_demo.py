"""The quick-start demo works end to end on embedded defaults."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT, free_port


def test_demo_serves_and_shows_the_three_examples() -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "gateway", "demo", "--duration", "1",
                          "--port", str(port), "--profile", "instant"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"gateway on http://127.0.0.1:{port}" in out.stdout
    assert '"object":"chat.completion"' in out.stdout  # the OpenAI example answered
    assert '"generated_text":"' in out.stdout  # the TGI stream reached its final event
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
    assert '"code":"context_length_exceeded"' in out.stdout  # the picker's own 400
    assert "endpoint picker (ext_proc) listening" in out.stderr
