from __future__ import annotations

from pathlib import Path

import pytest

from support import ROOT
from gateway.config import ConfigError, load_settings
from gateway.fleet.model import build_models


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


CONFIG = """
models:
  - name: llama-3-8b
    max_model_len: 8192
    pools:
      - name: stable
        weight: 95
        replicas:
          - {url: "http://127.0.0.1:8000", engine: vllm}
          - {host: 127.0.0.2, gpus: 8, base_port: 8000, engine: vllm}
      - name: canary
        weight: 5
        replicas:
          - {url: "http://127.0.0.1:8080", engine: tgi}
balancer: least_outstanding_tokens
redis_url: null
"""


def test_design_example_loads_and_gpu_shorthand_expands(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, CONFIG))
    model = build_models(settings)["llama-3-8b"]
    stable, canary = model.pools
    assert [r.url for r in stable.replicas][1:] == [f"http://127.0.0.2:{8000 + g}" for g in range(8)]
    assert len(stable.replicas) == 9 and canary.replicas[0].engine == "tgi"
    assert (stable.weight, canary.weight) == (95, 5)


def test_unknown_key_is_an_error_naming_the_key(tmp_path: Path) -> None:
    bad = CONFIG.replace("engine: tgi", "engine: tgi, enigne: x")
    with pytest.raises(ConfigError, match=r"models\.0\.pools\.1\.replicas\.0\.enigne"):
        load_settings(write(tmp_path, bad))
    with pytest.raises(ConfigError, match="balancr"):
        load_settings(write(tmp_path, CONFIG + "balancr: x\n"))


def test_bad_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="balancer"):
        load_settings(write(tmp_path, CONFIG.replace("balancer: least_outstanding_tokens", "balancer: fastest")))
    with pytest.raises(ConfigError, match="engine"):
        load_settings(write(tmp_path, CONFIG.replace("engine: tgi", "engine: tensorflow")))
    with pytest.raises(ConfigError, match="base_port"):
        load_settings(write(tmp_path, CONFIG.replace(", base_port: 8000", "")))


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_BALANCER", "round_robin")
    monkeypatch.setenv("GATEWAY_TIMEOUTS__CONNECT", "1.5")
    settings = load_settings(write(tmp_path, CONFIG))
    assert settings.balancer == "round_robin" and settings.timeouts.connect == 1.5


def test_models_from_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_MODELS", '[{"name": "m", "replicas": [{"url": "http://127.0.0.1:1"}]}]')
    assert load_settings().models[0].pools[0].replicas[0].url == "http://127.0.0.1:1"


def test_the_documented_config_examples_load(tmp_path: Path) -> None:
    """Every YAML block of the README and of docs/ that starts with `models:` is a config the
    gateway takes."""
    import re

    def blocks(path: Path) -> list[str]:
        return [b for b in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)
                if b.startswith("models:")]

    readme = blocks(ROOT / "README.md")
    docs = [b for page in sorted((ROOT / "docs").glob("*.md")) for b in blocks(page)]
    assert len(readme) >= 1  # the front page's example
    assert len(docs) >= 2  # "Running it" (docs/index.md) and "DNS discovery" (docs/deploy.md)
    for block in readme + docs:
        settings = load_settings(write(tmp_path, block))
        assert settings.models


def test_tracing_and_access_log_are_off_unless_configured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(write(tmp_path, CONFIG))
    assert not settings.tracing.enabled and not settings.access_log.enabled
    path = write(tmp_path, CONFIG + "tracing: {enabled: true, sampling: 0.01}\n"
                 "access_log: {enabled: true, path: /var/log/gw.jsonl, sampling: 0.5}\n")
    settings = load_settings(path)
    assert settings.tracing.sampling == 0.01 and settings.access_log.path == "/var/log/gw.jsonl"
    monkeypatch.setenv("GATEWAY_TRACING__SERVICE_NAME", "edge")
    assert load_settings(path).tracing.service_name == "edge"
    for bad, key in [("tracing: {sampling: 2}", "tracing.sampling"),
                     ("tracing: {endpoint: x, exporter: y}", "tracing.exporter"),
                     ("access_log: {sampling: -0.1}", "access_log.sampling"),
                     ("access_log: {path: ''}", "access_log.path")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_settings(write(tmp_path, CONFIG + bad + "\n"))
