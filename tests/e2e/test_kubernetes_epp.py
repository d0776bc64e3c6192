"""deploy/kubernetes/epp: llm-gateway as the Endpoint Picker (EPP) of a Gateway API Inference
Extension InferencePool, checked without a cluster (none here: nothing is applied, no Gateway
implementation runs). The kustomization builds with kubectl's kustomize; what it builds is
validated strictly: Deployments, Services, ConfigMaps and the rest against the Kubernetes
OpenAPI schemas (kubernetes-validate, as tests/e2e/test_kubernetes.py), the InferencePool,
Gateway and HTTPRoute against their CRDs (tests/crds, vendored from the projects' releases):
the openAPIV3Schema as JSON Schema (unknown fields refused, as `kubectl apply
--validate=strict`), then the CRDs' CEL rules (x-kubernetes-validations) evaluated by
cel-python on the defaulted object, as the API server would. Then checkov, the EPP's
gateway.yaml loaded as the gateway loads it, and the references between the pieces and to
the base's engines and Redis (which `kubectl apply -k deploy/kubernetes` installs)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import celpy
import jsonschema
import pytest
import yaml

from gateway.config import Settings, load_settings
from crd_support import KUBERNETES_VERSIONS, kubernetes_validate, strict
from support import ROOT, checkov

BASE = ROOT / "deploy" / "kubernetes"
EPP = BASE / "epp"
CRDS = ROOT / "tests" / "crds"
# Custom resources: kind -> (CRD file, apiVersion the manifests must use).
CUSTOM = {
    "InferencePool": ("inference.networking.k8s.io_inferencepools.yaml",
                      "inference.networking.k8s.io/v1"),
    "Gateway": ("gateway.networking.k8s.io_gateways.yaml", "gateway.networking.k8s.io/v1"),
    "HTTPRoute": ("gateway.networking.k8s.io_httproutes.yaml", "gateway.networking.k8s.io/v1"),
}

Objects = dict[tuple[str, str], dict[str, Any]]


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((EPP / "kustomization.yaml").read_text())


def build() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/kubernetes/epp` applies."""
    done = subprocess.run(["kubectl", "kustomize", str(EPP)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def built() -> list[dict[str, Any]]:
    return build()


def by_name(docs: list[dict[str, Any]]) -> Objects:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def base() -> Objects:
    """The base's objects (the engines, Redis), as deploy/kubernetes lists them."""
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return by_name([d for r in listed for d in yaml.safe_load_all((BASE / r).read_text())])


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def arg(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def test_the_kustomization_builds_every_manifest_into_the_bases_namespace(
        built: list[dict[str, Any]]) -> None:
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(p.name for p in EPP.glob("*.yaml")
                                    if p.name != "kustomization.yaml")
    from_files = by_name([d for r in listed for d in yaml.safe_load_all((EPP / r).read_text())])
    assert set(by_name(built)) == set(from_files) and len(built) == len(from_files)
    namespace = kustomization()["namespace"]
    assert ("Namespace", namespace) in base()  # the base creates it; this one does not
    for doc in built:
        assert doc["metadata"]["namespace"] == namespace
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llm-gateway"
    # Names the API server takes (kubernetes-validate and the CRD schemas leave metadata out).
    for kind, name in by_name(built):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name), (kind, name)


# --- the Kubernetes schemas (Deployment, Service, ConfigMap, ...) ---

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_core_manifest_matches_the_kubernetes_schemas(
        built: list[dict[str, Any]], version: str, tmp_path: Path) -> None:
    core = [d for d in built if d["kind"] not in CUSTOM]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "ConfigMap",
                                         "PodDisruptionBudget", "NetworkPolicy"}
    result = kubernetes_validate(core, version, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "WARN" not in out, out
    # Each one was checked against a schema (an unknown kind is only a warning).
    for doc in core:
        assert re.search(rf"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}"
                         rf" against", out), (doc["kind"], doc["metadata"]["name"], out)
    # The validator does reject what a cluster would: a misspelt field, a wrong type.
    deployment = by_name(built)[("Deployment", "llm-gateway-epp")]
    misspelt, wrong_type = copy.deepcopy(deployment), copy.deepcopy(deployment)
    container(misspelt)["readinessProbe"]["grcp"] = container(misspelt)["readinessProbe"].pop(
        "grpc")
    container(wrong_type)["livenessProbe"]["grpc"]["port"] = "grpc"  # no named gRPC ports
    for bad, error in [(misspelt, "grcp"), (wrong_type, "'grpc' is not of type")]:
        result = kubernetes_validate([bad], version, tmp_path)
        assert result.returncode != 0 and error in result.stdout + result.stderr


# --- the CRDs: schema and CEL rules ---

def openapi_schema(kind: str) -> dict[str, Any]:
    """The CRD's schema of the version the manifests use (served, and the storage version)."""
    path, api_version = CUSTOM[kind]
    group, version = api_version.split("/")
    crd = yaml.safe_load((CRDS / path).read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"] and served["storage"]
    return served["schema"]["openAPIV3Schema"]


def with_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """``obj`` with the schema's defaults filled in, as the API server does before it runs
    the CEL rules (which read defaulted fields: endpointPickerRef.kind, backendRef.group)."""
    obj = copy.deepcopy(obj)

    def fill(node: dict[str, Any], value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in node.get("properties", {}).items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    fill(sub, value[key])
            if isinstance(node.get("additionalProperties"), dict):
                for key in set(value) - set(node.get("properties", {})):
                    fill(node["additionalProperties"], value[key])
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for item in value:
                fill(node["items"], item)

    fill(schema, obj)
    return obj


# CEL's reserved words, which Kubernetes escapes as __word__ where a rule names a field so.
CEL_RESERVED = {"as", "break", "const", "continue", "else", "false", "for", "function", "if",
                "import", "in", "let", "loop", "package", "namespace", "null", "return",
                "true", "var", "void", "while"}


def cel_rules(schema: dict[str, Any], value: Any,
              path: str = "") -> Iterator[tuple[str, dict[str, Any], Any]]:
    """Every x-kubernetes-validations rule on a node that ``value`` sets, with that node."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in value.items():
            if key in schema.get("properties", {}):
                yield from cel_rules(schema["properties"][key], sub, f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from cel_rules(schema["additionalProperties"], sub, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from cel_rules(schema["items"], item, f"{path}[{i}]")


def unescape(rule: str) -> str:
    def word(match: re.Match[str]) -> str:
        assert match[1] in CEL_RESERVED, f"an escape this test does not read: {match[0]}"
        return match[1]

    return re.sub(r"__(\w+?)__", word, rule)


def cel_failures(obj: dict[str, Any]) -> list[str]:
    schema = openapi_schema(obj["kind"])
    environment = celpy.Environment()
    failures, evaluated = [], 0
    for path, rule, value in cel_rules(schema, with_defaults(schema, obj)):
        program = environment.program(environment.compile(unescape(rule["rule"])))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        assert isinstance(result, celpy.celtypes.BoolType), (path, rule["rule"], result)
        evaluated += 1
        if not result:
            failures.append(f"{path}: {rule.get('message', rule['rule'])}")
    assert evaluated, f"no CEL rule applies to {obj['kind']}: is the walk right?"
    return failures


def schema_errors(obj: dict[str, Any]) -> list[str]:
    kind = obj["kind"]
    assert obj["apiVersion"] == CUSTOM[kind][1]
    schema = strict(openapi_schema(kind))
    schema["properties"]["metadata"] = {"type": "object"}  # the API server checks metadata
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def errors(obj: dict[str, Any]) -> list[str]:
    return schema_errors(obj) or cel_failures(obj)


def custom(built: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [only] = [d for d in built if d["kind"] == kind]
    return copy.deepcopy(only)


def broken(obj: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Copies of ``obj`` a cluster would refuse, each with a word its error names: a
    misspelt field and a wrong type (the schema), a broken CEL rule."""
    misspelt, wrong, rule = (copy.deepcopy(obj) for _ in range(3))
    if obj["kind"] == "InferencePool":
        ref = misspelt["spec"]["endpointPickerRef"]
        ref["failuerMode"] = ref.pop("failureMode")
        wrong["spec"]["targetPorts"][0]["number"] = "8000"
        del rule["spec"]["endpointPickerRef"]["port"]  # kind defaults to Service: port needed
        return [(misspelt, "failuerMode"), (wrong, "is not of type"),
                (rule, "port is required when kind is 'Service'")]
    if obj["kind"] == "Gateway":
        listener = misspelt["spec"]["listeners"][0]
        listener["protocl"] = listener.pop("protocol")
        wrong["spec"]["listeners"][0]["port"] = "eighty"
        rule["spec"]["listeners"].append(dict(rule["spec"]["listeners"][0], port=8080))
        return [(misspelt, "protocl"), (wrong, "is not of type"),
                (rule, "Listener name must be unique")]
    backend = misspelt["spec"]["rules"][0]["backendRefs"][0]
    backend["nmae"] = backend.pop("name")
    wrong["spec"]["rules"][0]["timeouts"] = {"request": 300}
    rule["spec"]["rules"][0]["timeouts"] = {"request": "10s", "backendRequest": "20s"}
    return [(misspelt, "nmae"), (wrong, "is not of type"),
            (rule, "backendRequest timeout cannot be longer than request timeout")]


@pytest.mark.parametrize("kind", sorted(CUSTOM))
def test_every_custom_resource_matches_its_crd_schema_and_rules(
        built: list[dict[str, Any]], kind: str) -> None:
    assert {d["kind"] for d in built} >= set(CUSTOM)
    obj = custom(built, kind)
    assert schema_errors(obj) == []
    assert cel_failures(obj) == []
    # The checks do reject what a cluster would.
    for bad, error in broken(obj):
        found = errors(bad)
        assert any(error in e for e in found), (error, found)


# --- checkov ---

def test_checkov_passes_every_check_but_the_justified_skip() -> None:
    [report] = checkov("--framework", "kubernetes", "-d", str(EPP))
    assert report["summary"]["failed"] == 0, [
        (c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert report["summary"]["passed"] > 50 and report["summary"]["parsing_errors"] == 0
    skipped = report["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} == {"CKV_K8S_43"}  # image digests: per cluster
    for path in EPP.glob("*.yaml"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "checkov.io/skip" in line:
                assert lines[i - 1].lstrip().startswith("#"), f"{path.name}:{i + 1} unexplained"


# --- the EPP's config and Deployment ---

def epp_settings(objects: Objects, tmp_path: Path) -> Settings:
    """The ConfigMap's gateway.yaml, loaded as the EPP loads its --config file."""
    path = tmp_path / "gateway.yaml"
    path.write_text(objects[("ConfigMap", "llm-gateway-epp")]["data"]["gateway.yaml"])
    return load_settings(path)


def test_the_epp_runs_the_gateway_image_on_its_config_and_drains_in_time(
        built: list[dict[str, Any]], tmp_path: Path) -> None:
    objects = by_name(built)
    deployment = objects[("Deployment", "llm-gateway-epp")]
    pod = deployment["spec"]["template"]["spec"]
    epp = container(deployment)
    assert deployment["spec"]["replicas"] == 2
    gateway = base()[("Deployment", "llm-gateway")]
    assert epp["image"] == container(gateway)["image"]  # one image, two commands
    args = epp["args"]
    assert args[0] == "epp"
    config_path = Path(arg(args, "--config"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in epp["volumeMounts"]}
    assert mounts[str(config_path.parent)]["configMap"]["name"] == "llm-gateway-epp"
    assert config_path.name in objects[("ConfigMap", "llm-gateway-epp")]["data"]
    assert "emptyDir" in mounts["/tmp"]  # the root filesystem is read-only
    settings = epp_settings(objects, tmp_path)
    pre_stop = epp["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + settings.drain_timeout
    # gRPC probes on the ext_proc port, asking the health service for its two names.
    grpc_port = int(arg(args, "--grpc-port"))
    assert epp["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    assert epp["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "readiness"}
    ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert ports == {"grpc": grpc_port, "http": int(arg(args, "--port"))}


def test_the_epp_config_follows_the_engines_headless_service_and_shares_redis(
        built: list[dict[str, Any]], tmp_path: Path) -> None:
    settings = epp_settings(by_name(built), tmp_path)
    objects = base()
    namespace = kustomization()["namespace"]
    [model] = settings.models
    [replica] = [r for p in model.pools or [] for r in p.replicas]
    assert replica.dns, "the EPP finds its replicas by DNS"
    service_name, service_namespace = re.fullmatch(
        r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", replica.dns).groups()
    service = objects[("Service", service_name)]
    assert service_namespace == namespace and service["spec"]["clusterIP"] == "None"
    [port] = service["spec"]["ports"]
    assert port["port"] == replica.port
    engines = objects[("Deployment", "engines")]
    labels = engines["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["containerPort"] for p in container(engines)["ports"]} == {replica.port}
    # Redis: the base's Service, on its port, so that both EPP pods share one view.
    redis = re.fullmatch(r"redis://([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)/\d+",
                         settings.redis_url)
    assert redis, settings.redis_url
    assert redis[2] == namespace
    assert int(redis[3]) in {p["port"] for p in objects[("Service", redis[1])]["spec"]["ports"]}


# --- the references between the pieces ---

def test_the_inferencepool_selects_the_pods_the_epp_finds_by_dns(
        built: list[dict[str, Any]], tmp_path: Path) -> None:
    pool = custom(built, "InferencePool")
    objects = base()
    settings = epp_settings(by_name(built), tmp_path)
    [replica] = [r for m in settings.models for p in m.pools or [] for r in p.replicas]
    headless = objects[("Service", replica.dns.split(".")[0])]
    selector = pool["spec"]["selector"]["matchLabels"]
    # The same pods: the headless Service's selector, matching the engine pods' labels.
    assert selector == headless["spec"]["selector"]
    engine_labels = objects[("Deployment", "engines")]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= engine_labels.items()
    others = [name for (kind, name), d in objects.items() if kind == "Deployment" and
              selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert others == ["engines"], others  # not the gateway's pods nor Redis
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [replica.port]


def test_the_inferencepool_names_the_epp_service_and_its_grpc_port(
        built: list[dict[str, Any]]) -> None:
    objects = by_name(built)
    pool = custom(built, "InferencePool")
    ref = with_defaults(openapi_schema("InferencePool"), pool)["spec"]["endpointPickerRef"]
    assert (ref["group"], ref["kind"]) == ("", "Service")
    assert ref["failureMode"] == "FailClose"
    service = objects[("Service", ref["name"])]
    named = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert len(named) == 1, (ref, service["spec"]["ports"])
    [grpc] = named
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    deployment = objects[("Deployment", "llm-gateway-epp")]
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    epp = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert ports[grpc["targetPort"]] == int(arg(epp["args"], "--grpc-port"))
    [metrics] = [p for p in service["spec"]["ports"] if p is not grpc]
    assert ports[metrics["targetPort"]] == int(arg(epp["args"], "--port"))
    # Voluntary disruptions leave an EPP answering (FailClose: none means no requests).
    budget = objects[("PodDisruptionBudget", "llm-gateway-epp")]["spec"]
    assert budget["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert budget["maxUnavailable"] < deployment["spec"]["replicas"]


def test_the_httproute_sends_the_gateways_traffic_to_the_inferencepool(
        built: list[dict[str, Any]]) -> None:
    route, gateway, pool = (custom(built, k) for k in ("HTTPRoute", "Gateway", "InferencePool"))
    [parent] = route["spec"]["parentRefs"]
    assert (parent["group"], parent["kind"], parent["name"]) == (
        "gateway.networking.k8s.io", "Gateway", gateway["metadata"]["name"])
    assert parent.get("namespace", route["metadata"]["namespace"]) == \
        gateway["metadata"]["namespace"]
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert backend.get("namespace", route["metadata"]["namespace"]) == \
        pool["metadata"]["namespace"]
    # The listener takes this route: HTTP, routes from its own namespace (the default).
    [listener] = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTP"
    assert listener.get("allowedRoutes", {}).get("namespaces", {}).get("from", "Same") == "Same"
    assert route["metadata"]["namespace"] == gateway["metadata"]["namespace"]


# --- NetworkPolicies: the base's and these, as a cluster adds them up ---

def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # all these policies use
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(policies: list[dict[str, Any]], to: tuple[str, dict[str, str]], port: int,
           source: tuple[str, dict[str, str]]) -> bool:
    """Whether ingress to a pod (namespace, labels) on ``port`` from a pod (namespace,
    labels) is allowed, by the NetworkPolicy rules: allowed when no policy selects the pod,
    else when one selecting it has a rule whose peers and ports match."""
    namespace, labels = to
    source_namespace, source_labels = source
    applying = [p for p in policies if p["metadata"]["namespace"] == namespace
                and selects(p["spec"]["podSelector"], labels)]
    if not applying:
        return True

    def peer(p: dict[str, Any]) -> bool:
        namespace_labels = {"kubernetes.io/metadata.name": source_namespace}
        if "namespaceSelector" in p:
            in_namespace = selects(p["namespaceSelector"], namespace_labels)
        else:
            in_namespace = source_namespace == namespace
        return in_namespace and selects(p.get("podSelector", {}), source_labels)

    return any((not rule.get("from") or any(peer(p) for p in rule["from"]))
               and (not rule.get("ports") or port in [p["port"] for p in rule["ports"]])
               for policy in applying for rule in policy["spec"].get("ingress", []))


def test_the_network_policies_let_the_epp_and_the_proxies_through_and_no_one_else(
        built: list[dict[str, Any]]) -> None:
    objects, ours = base(), by_name(built)
    policies = [d for d in [*objects.values(), *ours.values()] if d["kind"] == "NetworkPolicy"]
    namespace = kustomization()["namespace"]

    def pod(deployment: dict[str, Any]) -> tuple[str, dict[str, str]]:
        return namespace, deployment["spec"]["template"]["metadata"]["labels"]

    epp = pod(ours[("Deployment", "llm-gateway-epp")])
    engines = pod(objects[("Deployment", "engines")])
    redis = pod(objects[("Deployment", "redis")])
    gateway_name = custom(built, "Gateway")["metadata"]["name"]
    proxies = {  # where each implementation runs the Gateway's proxies
        "istio, kgateway": (namespace, {"gateway.networking.k8s.io/gateway-name": gateway_name}),
        "envoy gateway": ("envoy-gateway-system",
                          {"gateway.envoyproxy.io/owning-gateway-name": gateway_name}),
    }
    engine_port = container(objects[("Deployment", "engines")])["ports"][0]["containerPort"]
    redis_port = container(objects[("Deployment", "redis")])["ports"][0]["containerPort"]
    epp_ports = [p["containerPort"] for p in container(ours[("Deployment", "llm-gateway-epp")])[
        "ports"]]
    assert admits(policies, redis, redis_port, epp)
    assert admits(policies, engines, engine_port, epp)
    for where, proxy in proxies.items():
        assert admits(policies, engines, engine_port, proxy), where
        for port in epp_ports:
            assert admits(policies, epp, port, proxy), (where, port)
    # Still closed to anyone else: a pod of another app, here or elsewhere.
    for stranger in [(namespace, {"app": "other"}), ("default", {"app": "other"}),
                     ("envoy-gateway-system", {"gateway.envoyproxy.io/owning-gateway-name":
                                               "another-gateway"})]:
        assert not admits(policies, engines, engine_port, stranger), stranger
        assert not admits(policies, redis, redis_port, stranger), stranger
    # The check can fail: without this directory's policies Redis refuses the EPP.
    base_only = [p for p in policies if (p["kind"], p["metadata"]["name"]) in objects]
    assert not admits(base_only, redis, redis_port, epp)
    assert not admits(base_only, engines, engine_port, proxies["istio, kgateway"])
