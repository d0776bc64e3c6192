"""deploy/docker-compose.yml, checked without a Docker engine: Docker Compose's own loader
(`docker-compose config`, the compose-spec schema and interpolation) accepts both profiles,
and its normalized model agrees with the files it mounts, the gateway config, Prometheus'
targets and Grafana's provisioning."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import load_settings
from support import ROOT, tool

COMPOSE = ROOT / "deploy" / "docker-compose.yml"
PROFILES = ("gpu", "sim")
ENGINE_CACHES = {"/root/.cache/huggingface", "/data"}  # the user's model cache, outside the repo
IMAGE_PORTS = {"prom/prometheus": 9090, "grafana/grafana": 3000, "redis": 6379}


def compose_config(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("docker-compose"), "-f", str(path), *args, "config",
                           "--format", "json"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/home/user"})


def normalized(profile: str) -> dict:
    result = compose_config(COMPOSE, "--profile", profile)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module", params=PROFILES)
def stack(request: pytest.FixtureRequest) -> dict:
    return normalized(request.param)


def gateway_config_path(stack: dict) -> Path:
    gateway = stack["services"]["gateway"]
    target = gateway["command"][gateway["command"].index("--config") + 1]
    [mount] = [v for v in gateway["volumes"] if v["target"] == target]
    return Path(mount["source"])


def listening(stack: dict) -> dict[str, int]:
    """Every name a container answers to on the compose network -> the port it listens on."""
    out = {}
    for name, service in stack["services"].items():
        command = service.get("command") or []
        if "--port" in command:
            port = int(command[command.index("--port") + 1])
        elif name == "gateway":
            port = load_settings(gateway_config_path(stack)).port
        else:
            port = IMAGE_PORTS[service["image"].split(":")[0]]
        aliases = [a for net in (service.get("networks") or {}).values() if net
                   for a in net.get("aliases", [])]
        for alias in (name, *aliases):
            out[alias] = port
    return out


def test_compose_accepts_both_profiles_and_rejects_an_unknown_key(tmp_path: Path) -> None:
    services = {p: set(normalized(p)["services"]) for p in PROFILES}
    common = {"gateway", "redis", "prometheus", "grafana"}
    assert services["gpu"] == common | {"vllm-0", "vllm-1", "tgi-0"}
    assert services["sim"] == common | {"sim-vllm-0", "sim-vllm-1", "sim-tgi-0"}
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  gateway:\n    image: x\n    gpus_per_replica: 1\n")
    result = compose_config(bad)
    assert result.returncode != 0 and "gpus_per_replica" in result.stderr


def test_every_mounted_file_exists(stack: dict) -> None:
    for name, service in stack["services"].items():
        for volume in service.get("volumes", []):
            assert volume["type"] == "bind", (name, volume)
            source = Path(volume["source"])
            if source.is_relative_to(ROOT):
                assert source.exists(), (name, volume)
                assert volume.get("read_only"), (name, volume)  # config, never written
            else:
                assert volume["target"] in ENGINE_CACHES, (name, volume)


def test_the_mounted_gateway_config_loads_and_names_the_engines(stack: dict) -> None:
    settings = load_settings(gateway_config_path(stack))
    names = listening(stack)
    assert settings.port == names["gateway"] == 8080 and settings.host == "0.0.0.0"
    assert urlsplit(settings.redis_url).hostname == "redis"
    urls = [r.url for m in settings.models for p in m.pools or [] for r in p.replicas]
    assert urls
    for url in urls:
        parts = urlsplit(url)
        assert names.get(parts.hostname) == parts.port, url


def test_prometheus_scrapes_the_services_on_their_ports(stack: dict) -> None:
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    names = listening(stack)
    targets = {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
               for job in scrape["scrape_configs"]}
    settings = load_settings(gateway_config_path(stack))
    engines = {urlsplit(r.url).netloc for m in settings.models for p in m.pools or []
               for r in p.replicas}
    assert targets["llm-gateway"] == [f"gateway:{names['gateway']}"]
    assert set(targets["llm-engines"]) == engines
    for target in targets["llm-gateway"] + targets["llm-engines"]:
        host, port = target.split(":")
        assert names.get(host) == int(port), target
    prometheus = stack["services"]["prometheus"]
    assert any(v["target"] == "/etc/prometheus/prometheus.yml" and
               Path(v["source"]) == ROOT / "deploy" / "prometheus.yml"
               for v in prometheus["volumes"])


def test_grafana_is_provisioned_with_our_datasource_and_dashboards(stack: dict) -> None:
    grafana = stack["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"
    [datasource] = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = urlsplit(datasource["url"])
    assert listening(stack)[url.hostname] == url.port == 9090
    [provider] = yaml.safe_load(
        (provisioning / "dashboards" / "llm-gateway.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert dashboards == ROOT / "dashboards" and list(dashboards.glob("*.json"))


def test_one_engine_container_per_gpu_with_the_engines_limits() -> None:
    stack = normalized("gpu")
    engines = {n: s for n, s in stack["services"].items() if n.startswith(("vllm-", "tgi-"))}
    gpus = []
    for name, service in engines.items():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1, name
        gpus += device["device_ids"]
        command = service["command"]
        flag = lambda f: int(command[command.index(f) + 1])  # noqa: E731
        if name.startswith("vllm-"):
            assert service["image"].startswith("vllm/vllm-openai:") and flag("--max-model-len")
        else:
            assert service["image"].startswith("ghcr.io/huggingface/text-generation-inference:")
            assert flag("--max-input-length") < flag("--max-total-tokens")
            assert flag("--max-concurrent-requests") > 0
    assert len(gpus) == len(set(gpus)) == len(engines) == 3


def test_sim_profile_runs_the_same_fleet_simulated() -> None:
    gpu, sim = normalized("gpu"), normalized("sim")
    engines = {n for n in gpu["services"] if n.startswith(("vllm-", "tgi-"))}
    names = listening(sim)
    assert engines <= set(names)
    for name in engines:
        service = sim["services"][f"sim-{name}"]
        command = service["command"]
        assert service["image"] == gpu["services"]["gateway"]["image"]  # our image, no GPU
        assert "deploy" not in service or not service["deploy"].get("resources")
        assert command[:3] == ["sim", "--dialect", name.split("-")[0]]


def test_tracing_profile_sends_the_gateways_spans_through_a_collector_to_jaeger() -> None:
    stack = normalized("tracing")
    assert set(stack["services"]) >= {"gateway", "otel-collector", "jaeger"}
    env = stack["services"]["gateway"]["environment"]
    assert env["GATEWAY_TRACING__ENABLED"] == "false"  # off unless GATEWAY_TRACING=true
    endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    collector = stack["services"]["otel-collector"]
    [mount] = collector["volumes"]
    assert mount["read_only"] and collector["command"][1] == mount["target"]
    config = yaml.safe_load(Path(mount["source"]).read_text())
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert endpoint.hostname == "otel-collector" and endpoint.port == int(http.split(":")[1])
    exporters = config["service"]["pipelines"]["traces"]["exporters"]
    assert all(config["exporters"][e]["endpoint"].startswith("jaeger:") for e in exporters)
    on = subprocess.run([tool("docker-compose"), "-f", str(COMPOSE), "--profile", "tracing",
                         "config", "--format", "json"], capture_output=True, text=True,
                        timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/home/user",
                                         "GATEWAY_TRACING": "true"})
    assert json.loads(on.stdout)["services"]["gateway"]["environment"][
        "GATEWAY_TRACING__ENABLED"] == "true"
