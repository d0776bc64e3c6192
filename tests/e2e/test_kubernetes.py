"""deploy/kubernetes (a kustomize base), checked without a cluster: every manifest against
the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), checkov's
security scan, and the promises between the pieces (probes, drain time, DNS discovery of the
engines' headless Service, the config the gateway loads)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.config import Settings, load_settings
from crd_support import KUBERNETES_VERSIONS
from support import ROOT, checkov, tool

BASE = ROOT / "deploy" / "kubernetes"


def kustomization() -> dict:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


def manifests() -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, over the kustomization's resources."""
    out = {}
    for resource in kustomization()["resources"]:
        for doc in yaml.safe_load_all((BASE / resource).read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def validate(*paths: Path, version: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", version,
                           *map(str, paths)], capture_output=True, text=True, timeout=120)


def container(deployment: dict) -> dict:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_kustomization_lists_every_manifest_and_one_namespace() -> None:
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(p.name for p in BASE.glob("*.yaml")
                                    if p.name != "kustomization.yaml")
    namespace = kustomization()["namespace"]
    for (kind, name), obj in manifests().items():
        assert obj["metadata"].get("namespace", namespace) == namespace or kind == "Namespace"
    assert manifests()[("Namespace", namespace)]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_matches_the_kubernetes_schemas(version: str, tmp_path: Path) -> None:
    result = validate(*(BASE / r for r in kustomization()["resources"]), version=version)
    assert result.returncode == 0, result.stdout + result.stderr
    # The validator does reject what a cluster would: a misspelt field, a wrong type.
    misspelt = manifests()[("Deployment", "llm-gateway")]
    container(misspelt)["readinesProbe"] = container(misspelt).pop("readinessProbe")
    wrong_type = manifests()[("Deployment", "llm-gateway")]
    wrong_type["spec"]["replicas"] = "two"
    for bad, error in [(misspelt, "readinesProbe"), (wrong_type, "'two' is not of type")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        result = validate(path, version=version)
        assert result.returncode != 0 and error in result.stdout + result.stderr


def test_checkov_passes_every_check_but_the_justified_skips() -> None:
    [report] = checkov("--framework", "kubernetes", "-d", str(BASE))
    assert report["summary"]["failed"] == 0, [
        (c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert report["summary"]["passed"] > 200 and report["summary"]["parsing_errors"] == 0
    skipped = report["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} == {"CKV_K8S_43"}  # image digests: per cluster
    for path in BASE.glob("*.yaml"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "checkov.io/skip" in line:
                assert lines[i - 1].lstrip().startswith("#"), f"{path.name}:{i + 1} unexplained"


def test_gateway_drains_within_its_grace_period_as_non_root_read_only(tmp_path: Path) -> None:
    objects = manifests()
    deployment = objects[("Deployment", "llm-gateway")]
    pod = deployment["spec"]["template"]["spec"]
    gateway = container(deployment)
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    settings = config_settings(objects, tmp_path)
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + settings.drain_timeout
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert gateway["securityContext"]["readOnlyRootFilesystem"]
    assert gateway["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"cpu", "memory"} <= set(gateway["resources"]["requests"]) & \
        set(gateway["resources"]["limits"])
    # --workers N writes its metrics files under the temporary directory: a writable emptyDir.
    args = gateway["args"]
    assert int(args[args.index("--workers") + 1]) > 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in gateway["volumeMounts"]}
    assert "emptyDir" in mounts["/tmp"]
    config_path = Path(args[args.index("--config") + 1])
    assert mounts[str(config_path.parent)]["configMap"]["name"] == "llm-gateway"
    assert config_path.name in objects[("ConfigMap", "llm-gateway")]["data"]


def config_settings(objects: dict, tmp_path: Path) -> Settings:
    """The ConfigMap's gateway.yaml, loaded as the gateway loads its --config file."""
    path = tmp_path / "gateway.yaml"
    path.write_text(objects[("ConfigMap", "llm-gateway")]["data"]["gateway.yaml"])
    return load_settings(path)


def test_the_gateway_config_discovers_the_engines_headless_service(tmp_path: Path) -> None:
    objects = manifests()
    namespace = kustomization()["namespace"]
    settings = config_settings(objects, tmp_path)
    [dns_entry] = [r for m in settings.models for p in m.pools or [] for r in p.replicas
                   if r.dns]
    service_name, service_namespace = re.fullmatch(
        r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", dns_entry.dns).groups()
    service = objects[("Service", service_name)]
    assert service_namespace == namespace and service["spec"]["clusterIP"] == "None"
    [port] = service["spec"]["ports"]
    assert port["port"] == dns_entry.port
    engines = objects[("Deployment", "engines")]
    labels = engines["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    engine = container(engines)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"  # ready pods only in DNS
    assert {p["containerPort"] for p in engine["ports"]} == {dns_entry.port}
    redis_host = re.match(r"redis://([^:/]+)", settings.redis_url).group(1)
    assert redis_host.split(".")[0] in {name for kind, name in objects if kind == "Service"}


def test_gateway_service_budget_and_autoscaler_point_at_the_gateway() -> None:
    objects = manifests()
    labels = objects[("Deployment", "llm-gateway")]["spec"]["template"]["metadata"]["labels"]
    assert objects[("Service", "llm-gateway")]["spec"]["selector"].items() <= labels.items()
    pdb = objects[("PodDisruptionBudget", "llm-gateway")]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    hpa = objects[("HorizontalPodAutoscaler", "llm-gateway")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "llm-gateway"}
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]


TRACING = BASE / "tracing"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_tracing_component_is_valid_and_points_the_gateway_at_its_collector(
        version: str, tmp_path: Path) -> None:
    component = yaml.safe_load((TRACING / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    result = validate(*(TRACING / r for r in component["resources"]), version=version)
    assert result.returncode == 0, result.stdout + result.stderr
    # Applied to the base in an overlay, as the component's comment says.
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [os.path.relpath(BASE, overlay)],
         "components": [os.path.relpath(TRACING, overlay)]}))
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(built.stdout)}
    env = {e["name"]: e["value"] for e in container(docs[("Deployment", "llm-gateway")])["env"]}
    settings = load_settings(None, **yaml.safe_load(
        docs[("ConfigMap", "llm-gateway")]["data"]["gateway.yaml"]),
        tracing={"enabled": env["GATEWAY_TRACING__ENABLED"] == "true"})
    assert settings.tracing.enabled
    service = docs[("Service", "otel-collector")]
    endpoint = re.fullmatch(r"http://([^.]+)\.([^.]+)\.svc\.cluster\.local:(\d+)",
                            env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint and endpoint[1] == "otel-collector" and endpoint[2] == service["metadata"][
        "namespace"] and int(endpoint[3]) == service["spec"]["ports"][0]["port"]
    collector = yaml.safe_load(docs[("ConfigMap", "otel-collector")]["data"]["config.yaml"])
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(
        f":{endpoint[3]}")
    # The collector admits the gateway's pods.
    policy = docs[("NetworkPolicy", "otel-collector")]
    assert {"app.kubernetes.io/name": "llm-gateway"} in [
        p["podSelector"]["matchLabels"] for p in policy["spec"]["ingress"][0]["from"]]


def test_checkov_passes_the_tracing_component() -> None:
    [report] = checkov("-f", str(TRACING / "otel-collector.yaml"), "--framework", "kubernetes")
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert not failed, failed
