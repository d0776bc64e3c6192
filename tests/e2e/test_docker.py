"""The Dockerfile, checked statically (no Docker engine here): hadolint and checkov clean,
and the properties the README promises, read from the file itself."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from support import ROOT, checkov, tool

DOCKERFILE = ROOT / "Dockerfile"


def hadolint(path: Path) -> list[dict]:
    result = subprocess.run([tool("hadolint"), "--format", "json", "--failure-threshold", "style",
                             str(path)], capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout)


def stages(text: str) -> list[list[str]]:
    """Instructions (continuations joined, comments dropped) of each FROM stage."""
    lines = [l for l in text.replace("\\\n", " ").splitlines()
             if l.strip() and not l.lstrip().startswith("#")]
    out: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(" ".join(line.split()))
    return out


def test_hadolint_finds_nothing_and_would_find_a_bad_file(tmp_path: Path) -> None:
    assert hadolint(DOCKERFILE) == []
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install uvicorn\n")
    assert {f["code"] for f in hadolint(bad)} >= {"DL3007", "DL3013"}


def test_checkov_passes_every_check_and_would_fail_a_bad_file(tmp_path: Path) -> None:
    [report] = checkov("--framework", "dockerfile", "-f", str(DOCKERFILE))
    assert report["summary"]["failed"] == 0, report["results"]["failed_checks"]
    assert report["summary"]["passed"] > 20 and report["summary"]["parsing_errors"] == 0
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install uvicorn\n")
    [report] = checkov("--framework", "dockerfile", "-f", str(bad))
    failed = {c["check_id"] for c in report["results"]["failed_checks"]}
    assert {"CKV_DOCKER_2", "CKV_DOCKER_3", "CKV_DOCKER_7"} <= failed  # healthcheck, user, tag


def test_suppressions_are_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line or "checkov:skip" in line:
            assert re.search(r"(ignore=|skip=)\S+.*\S", line) and lines[i - 1].startswith("#"), \
                f"line {i + 1}: a suppression needs the reason in a comment above it"


def test_multi_stage_slim_non_root_runtime() -> None:
    build, runtime = stages(DOCKERFILE.read_text())
    assert build[0].endswith(" AS build") and "pip wheel" in " ".join(build)
    final = " ".join(runtime)
    assert re.match(r"FROM python:3\.1[1-9][\d.]*-slim", runtime[0])  # slim: no gcc, no headers
    # No compilers or build tools come in later, and only wheels are installed (--no-index).
    assert not re.search(r"apt-get|apk |gcc|build-essential|python3-dev", final)
    assert "--no-index" in final and "from=build" in final
    assert 'python -c "import uvloop, httptools"' in final  # the build fails without them
    user = [i for i in runtime if i.startswith("USER ")]
    assert user and user[-1].split()[1] not in {"root", "0"}
    assert "EXPOSE 8080" in runtime and "GATEWAY_HOST=0.0.0.0" in final
    assert 'ENTRYPOINT ["llm-gateway"]' in runtime
    health = next(i for i in runtime if i.startswith("HEALTHCHECK"))
    assert "/health" in health and "GATEWAY_PORT" in health
    cmd = json.loads(next(i for i in runtime if i.startswith("CMD "))[4:])
    assert cmd[:2] == ["serve", "--config"]


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    """The build context: the package and its metadata, never local state."""
    patterns = [l for l in (ROOT / ".dockerignore").read_text().splitlines()
                if l and not l.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {part.rstrip("/").removeprefix("./")
              for line in stages(DOCKERFILE.read_text())[0] if line.startswith("COPY ")
              for part in line.split()[1:-1]}
    assert copied == allowed == {"pyproject.toml", "README.md", "gateway"}
