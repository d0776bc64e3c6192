"""The command line: every subcommand is listed and has complete --help; a subcommand loads
only its own module (``llm-gateway sim`` does not import the gateway's web stack)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.cli import SUBCOMMANDS
from support import ROOT


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_each_subcommand_has_help(command: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gateway", command, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: llm-gateway {command}")


def test_a_subcommand_imports_only_its_own_module() -> None:
    probe = ("import sys; from gateway.cli import build_parser; "
             "build_parser(['sim', '--help'][:1]); "
             "print(sorted(m for m in ('gateway.app', 'fastapi', 'gateway.serve') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    listed = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60).stdout
    assert all(name in listed for name in SUBCOMMANDS)


@pytest.mark.parametrize("extra,env,named", [
    ({"access_log": {"enabled": True, "path": "/nonexistent-dir/access.log"}}, {},
     "access_log.path"),
    ({"tracing": {"enabled": True}}, {"OTEL_TRACES_SAMPLER_ARG": "most"},
     "OTEL_TRACES_SAMPLER_ARG"),
])
def test_serve_refuses_what_observability_cannot_use_before_it_starts(
        tmp_path, extra: dict, env: dict, named: str) -> None:  # noqa: ANN001 - tmp_path
    import json
    import os

    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"models": [{"name": "m", "replicas": [
        {"url": "http://127.0.0.1:9", "engine": "vllm"}]}], **extra}))
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(config),
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr
