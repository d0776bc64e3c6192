"""deploy/kubernetes/autoscaling: the engines scaled on the gateway's demand signal
(llm_gateway_desired_replicas), by KEDA (the kustomization's ScaledObject) or by a plain HPA
on an External metric that prometheus-adapter serves. Checked without a cluster: the
ScaledObject against KEDA's CRD (tests/crds, vendored from the release; strict: an unknown
field fails, as `kubectl apply --validate=strict`), the HPA and the adapter's ConfigMap
against the Kubernetes schemas (kubernetes-validate), the adapter's config against its
config type (it loads it with yaml.UnmarshalStrict), the kustomization built by kubectl's
kustomize (which refuses an unknown field). Then the references: the Deployment scaled is
the base's engines, the model and pool queried are the ones gateway-config.yaml serves.
Last, the PromQL: parsed by promtool, and run against what two real gateway instances
(serving that model, as that config does) publish while a real Prometheus scrapes them:
KEDA's query and the adapter's (its template filled as the adapter fills it from the HPA's
selector) return one sample, the sum of the instances' shares, 0 before any request (KEDA
stays inactive) and above 0 after one."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from gateway.config import Settings, load_settings
from gateway.fleet.role import Role
from prometheus_support import prometheus
from crd_support import KUBERNETES_VERSIONS, kubernetes_validate, strict
from support import ROOT, gateway_server, sim, wait_for_value

BASE = ROOT / "deploy" / "kubernetes"
AUTOSCALING = BASE / "autoscaling"
KEDA_CRD = ROOT / "tests" / "crds" / "keda.sh_scaledobjects.yaml"
SIGNAL = "llm_gateway_desired_replicas"

# KEDA's prometheus scaler's metadata keys at the vendored release (v2.20.2,
# pkg/scalers/prometheus_scaler.go, prometheusMetadata). The CRD takes any string map there,
# so a misspelt key (activationTreshold) would pass it and be ignored by KEDA.
KEDA_PROMETHEUS_KEYS = {"serverAddress", "query", "queryParameters", "threshold",
                        "activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                        "unsafeSsl", "awsRegion", "timeout", "identityOwner"}

# prometheus-adapter's config file type (v0.12.0, pkg/config/config.go), which it loads with
# yaml.UnmarshalStrict: an unknown field stops the adapter.
_STRING = {"type": "string"}
_RULE = {"type": "object", "additionalProperties": False, "required": ["seriesQuery"],
         "properties": {
             "seriesQuery": _STRING,
             "seriesFilters": {"type": "array", "items": {
                 "type": "object", "additionalProperties": False,
                 "properties": {"is": _STRING, "isNot": _STRING}}},
             "resources": {"type": "object", "additionalProperties": False, "properties": {
                 "template": _STRING, "namespaced": {"type": "boolean"},
                 "overrides": {"type": "object", "additionalProperties": {
                     "type": "object", "additionalProperties": False, "required": ["resource"],
                     "properties": {"group": _STRING, "resource": _STRING}}}}},
             "name": {"type": "object", "additionalProperties": False,
                      "properties": {"matches": _STRING, "as": _STRING}},
             "metricsQuery": _STRING}}
ADAPTER_CONFIG = {"type": "object", "additionalProperties": False,
                  "properties": {"rules": {"type": "array", "items": _RULE},
                                 "externalRules": {"type": "array", "items": _RULE},
                                 "resourceRules": {"type": "object"}}}

assert shutil.which("kubectl"), "run make test (scripts/setup.sh installs kubectl)"
assert shutil.which("prometheus") and shutil.which("promtool"), "run make test (it installs them)"


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((AUTOSCALING / name).read_text())


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def built() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/kubernetes/autoscaling` applies."""
    done = kustomize(AUTOSCALING)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def scaled_object(built: list[dict[str, Any]]) -> dict[str, Any]:
    [obj] = [d for d in built if d["kind"] == "ScaledObject"]
    return obj


def base() -> dict[tuple[str, str], dict[str, Any]]:
    """The base's objects, as deploy/kubernetes lists them."""
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    docs = [d for r in listed for d in yaml.safe_load_all((BASE / r).read_text())]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def served(tmp: Path) -> Settings:
    """The base's gateway.yaml (ConfigMap llm-gateway), loaded as the gateway loads it."""
    path = tmp / "gateway.yaml"
    path.write_text(base()[("ConfigMap", "llm-gateway")]["data"]["gateway.yaml"])
    return load_settings(path)


def keda_trigger(obj: dict[str, Any]) -> dict[str, Any]:
    [trigger] = obj["spec"]["triggers"]
    return trigger


def keda_query(obj: dict[str, Any]) -> str:
    return keda_trigger(obj)["metadata"]["query"]


def adapter_rule() -> dict[str, Any]:
    config = yaml.safe_load(manifest("prometheus-adapter-rules.yaml")["data"]["config.yaml"])
    [rule] = config["externalRules"]
    return rule


def hpa_metric() -> dict[str, Any]:
    [metric] = manifest("hpa-external.yaml")["spec"]["metrics"]
    return metric["external"]


def adapter_query(series: str) -> str:
    """The adapter's metricsQuery as it runs it for the HPA (BuildExternal, v0.12.0):
    .Series the series name, .LabelMatchers the HPA's matchLabels as `k="v"` sorted by key
    and joined by commas (no namespace matcher: the rule is not namespaced)."""
    labels = hpa_metric()["metric"]["selector"]["matchLabels"]
    matchers = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    template = adapter_rule()["metricsQuery"]
    return template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)


def selector_labels(query: str) -> dict[str, str]:
    """The equality matchers of the query's one selector of the signal."""
    [inside] = re.findall(rf"{SIGNAL}\{{([^}}]*)\}}", query)
    pairs = [p.strip() for p in inside.split(",") if p.strip()]
    out = {}
    for pair in pairs:
        match = re.fullmatch(r'(\w+)="([^"]*)"', pair)
        assert match, f"not an equality matcher: {pair}"
        out[match[1]] = match[2]
    return out


# --- the manifests ---

def test_the_kustomization_builds_the_scaledobject_and_refuses_an_unknown_field(
        built: list[dict[str, Any]], tmp_path: Path) -> None:
    assert {p.name for p in AUTOSCALING.iterdir()} == {
        "kustomization.yaml", "keda-scaledobject.yaml", "hpa-external.yaml",
        "prometheus-adapter-rules.yaml"}
    kustomization = manifest("kustomization.yaml")
    # KEDA's path only: the HPA is its alternative (two autoscalers on one Deployment fight)
    # and the adapter's config lives in the adapter's namespace.
    assert kustomization["resources"] == ["keda-scaledobject.yaml"]
    assert [(d["kind"], d["metadata"]["name"]) for d in built] == [("ScaledObject", "engines")]
    assert ("Namespace", kustomization["namespace"]) in base()  # the base creates it
    for doc in built:
        assert doc["metadata"]["namespace"] == kustomization["namespace"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llm-gateway"
    # It is not in the base (which needs no KEDA).
    assert not any("autoscaling" in r for r in
                   yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    # kustomize reads the kustomization strictly: a misspelt field fails the build.
    copied = tmp_path / "autoscaling"
    shutil.copytree(AUTOSCALING, copied)
    text = (copied / "kustomization.yaml").read_text()
    (copied / "kustomization.yaml").write_text(text.replace("resources:", "resourcs:"))
    done = kustomize(copied)
    assert done.returncode != 0 and "resourcs" in done.stderr, done.stderr


def keda_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert crd["spec"]["group"] == "keda.sh" and crd["spec"]["names"]["kind"] == "ScaledObject"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert version["served"] and version["storage"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # the API server checks it itself
    return schema


def keda_errors(obj: dict[str, Any]) -> list[str]:
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    validator = jsonschema.Draft7Validator(keda_schema())
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_the_scaledobject_matches_kedas_crd_schema(scaled_object: dict[str, Any]) -> None:
    assert keda_errors(scaled_object) == []
    # The check does reject what a cluster would: a misspelt field, a wrong type, a number
    # where KEDA's trigger metadata takes only strings.
    misspelt, wrong, number = (copy.deepcopy(scaled_object) for _ in range(3))
    misspelt["spec"]["minReplicaCont"] = misspelt["spec"].pop("minReplicaCount")
    wrong["spec"]["pollingInterval"] = "15"
    keda_trigger(number)["metadata"]["threshold"] = 1
    assert any("minReplicaCont" in e for e in keda_errors(misspelt)), keda_errors(misspelt)
    assert any("is not of type" in e for e in keda_errors(wrong)), keda_errors(wrong)
    assert any("threshold" in e for e in keda_errors(number)), keda_errors(number)
    # The trigger's metadata keys are ones KEDA's prometheus scaler reads.
    trigger = keda_trigger(scaled_object)
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) <= KEDA_PROMETHEUS_KEYS, set(trigger["metadata"])


def test_the_scaledobject_scales_from_zero_on_any_demand_rounding_the_sum_up(
        scaled_object: dict[str, Any]) -> None:
    spec = scaled_object["spec"]
    trigger = keda_trigger(scaled_object)
    meta = trigger["metadata"]
    # KEDA's HPA: replicas = ceil(value / threshold) = ceil(sum); active above 0.
    assert trigger["metricType"] == "AverageValue" and float(meta["threshold"]) == 1
    assert float(meta["activationThreshold"]) == 0
    assert meta["ignoreNullValues"] == "false"  # no series is an error, not "scale to zero"
    assert meta["query"].startswith(f"sum({SIGNAL}{{") and meta["query"].endswith("})")
    assert re.fullmatch(r"https?://[a-z0-9.-]+(:\d+)?", meta["serverAddress"])
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 300)
    # The gateway smooths the way down itself: at most a short window on top.
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert 0 <= scale_down["stabilizationWindowSeconds"] <= 60


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_hpa_and_the_adapters_configmap_match_the_kubernetes_schemas(
        version: str, tmp_path: Path) -> None:
    docs = [manifest("hpa-external.yaml"), manifest("prometheus-adapter-rules.yaml")]
    result = kubernetes_validate(docs, version, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "WARN" not in out, out
    for doc in docs:  # each one checked against a schema (an unknown kind only warns)
        assert re.search(rf"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}"
                         rf" against", out), (doc["kind"], out)
    # The validator does reject what a cluster would: a misspelt field, a wrong type.
    misspelt, wrong = copy.deepcopy(docs[0]), copy.deepcopy(docs[0])
    target = misspelt["spec"]["metrics"][0]["external"]["target"]
    target["averageValu"] = target.pop("averageValue")
    wrong["spec"]["minReplicas"] = "one"
    for bad, error in [(misspelt, "averageValu"), (wrong, "'one' is not of type")]:
        result = kubernetes_validate([bad], version, tmp_path)
        assert result.returncode != 0 and error in result.stdout + result.stderr


def test_the_hpa_asks_the_adapter_for_the_summed_signal_from_one_replica() -> None:
    hpa = manifest("hpa-external.yaml")
    metric = hpa_metric()
    assert metric["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert hpa["spec"]["minReplicas"] == 1 <= hpa["spec"]["maxReplicas"]  # no HPAScaleToZero
    assert 0 <= hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] <= 60
    config = yaml.safe_load(manifest("prometheus-adapter-rules.yaml")["data"]["config.yaml"])
    jsonschema.validate(config, ADAPTER_CONFIG)
    bad = copy.deepcopy(config)
    bad["externalRules"][0]["metricQuery"] = bad["externalRules"][0].pop("metricsQuery")
    with pytest.raises(jsonschema.ValidationError, match="metricQuery"):
        jsonschema.validate(bad, ADAPTER_CONFIG)
    rule = adapter_rule()
    # The name the HPA asks for is the one the rule gives the series.
    assert re.fullmatch(rule["name"]["matches"], SIGNAL)
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], SIGNAL) == metric["metric"]["name"]
    # Not namespaced: the HPA's namespace is not added as a label the series may lack.
    assert rule["resources"] == {"namespaced": False}
    # An external rule gets only .Series and .LabelMatchers (.GroupBy is empty there).
    assert set(re.findall(r"<<(.*?)>>", rule["metricsQuery"])) == {".Series", ".LabelMatchers"}
    assert rule["metricsQuery"].startswith("sum(")
    assert selector_labels(adapter_query(SIGNAL)) == metric["metric"]["selector"]["matchLabels"]


def test_both_scale_the_base_engines_on_the_model_and_pool_the_gateway_serves(
        scaled_object: dict[str, Any], tmp_path: Path) -> None:
    engines = base()[("Deployment", "engines")]
    [container] = engines["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("vllm/")  # the base's vLLM engine Deployment
    hpa = manifest("hpa-external.yaml")
    for obj in (scaled_object, hpa):
        ref = obj["spec"]["scaleTargetRef"]
        assert ref == {"apiVersion": "apps/v1", "kind": "Deployment",
                       "name": engines["metadata"]["name"]}
        assert obj["metadata"]["namespace"] == engines["metadata"]["namespace"]
    labels = selector_labels(keda_query(scaled_object))
    assert labels == hpa_metric()["metric"]["selector"]["matchLabels"]
    assert set(labels) == {"model", "pool", "role"}
    settings = served(tmp_path)
    models = {m.name: m for m in settings.models}
    assert labels["model"] in models, (labels, list(models))
    pools = {p.name: p for p in models[labels["model"]].pools}
    assert labels["pool"] in pools, (labels, list(pools))
    # role "both": the pool's engines are ordinary ones, neither prefill nor decode.
    assert labels["role"] == Role.BOTH.value
    assert all(r.role == Role.BOTH for r in pools[labels["pool"]].replicas)
    # The engines serve that name (vLLM's --served-model-name).
    args = container["args"]
    assert args[args.index("--served-model-name") + 1] == labels["model"]


# --- the PromQL ---

def test_promtool_parses_the_queries(scaled_object: dict[str, Any], tmp_path: Path) -> None:
    def check(exprs: list[str]) -> subprocess.CompletedProcess:
        rules = {"groups": [{"name": "autoscaling", "rules": [
            {"record": f"autoscaling:query{i}", "expr": e} for i, e in enumerate(exprs)]}]}
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump(rules))
        return subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                              text=True, timeout=60)

    queries = [keda_query(scaled_object), adapter_query(SIGNAL), adapter_rule()["seriesQuery"]]
    done = check(queries)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout, done.stdout
    # It does refuse a broken one.
    done = check([keda_query(scaled_object)[:-1]])
    assert done.returncode != 0, done.stdout + done.stderr


def query(prom: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    reply = httpx.get(prom + "/api/v1/query", params=params, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    assert reply["data"]["resultType"] == "vector", reply
    return reply["data"]["result"]


def promtool_query(prom: str, expr: str, at: float) -> list[dict[str, Any]]:
    done = subprocess.run(["promtool", "query", "instant", "--format=json",
                           f"--time={at:.3f}", prom, expr],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def value(sample: dict[str, Any]) -> float:
    return float(sample["value"][1])


def test_the_queries_return_the_instances_summed_signal_from_real_gateways(
        scaled_object: dict[str, Any], tmp_path: Path) -> None:
    keda = keda_query(scaled_object)
    adapter = adapter_query(SIGNAL)
    labels = selector_labels(keda)
    per_instance = f'{SIGNAL}{{model="{labels["model"]}",pool="{labels["pool"]}",' \
                   f'role="{labels["role"]}"}}'
    # The shipped gateway.yaml, its engines found by DNS swapped for a simulated replica on
    # loopback, and no Redis: the model and pool are named as in the cluster. The signal
    # follows demand at once (scale_down_after 0: no value held from before, so idle is 0).
    shipped = yaml.safe_load(base()[("ConfigMap", "llm-gateway")]["data"]["gateway.yaml"])
    [model] = [m for m in shipped["models"] if m["name"] == labels["model"]]
    with sim("vllm", model["name"], 8192) as replica:
        model = {**model, "replicas": [{"url": replica, "engine": "vllm"}]}
        config = {"models": [model], "default_model": shipped["default_model"],
                  "health": {"interval": 0.5}, "autoscale": {"scale_down_after": 0}}
        with gateway_server(tmp_path, config) as (gw_a, _), \
                gateway_server(tmp_path, config) as (gw_b, _), \
                prometheus(tmp_path, [gw_a, gw_b]) as prom:
            # Before any request: each instance publishes 0, so the sum is 0 and KEDA stays
            # inactive (not above activationThreshold 0).
            wait_for_value(lambda: query(prom, per_instance),
                           lambda got: len(got) == 2 and all(value(s) == 0 for s in got), 20,
                           "Prometheus to see both gateways idle", every=0.25)
            at = time.time()
            assert len(query(prom, per_instance, at)) == 2
            [before] = query(prom, keda, at)
            assert value(before) == 0.0 <= float(
                keda_trigger(scaled_object)["metadata"]["activationThreshold"])

            # One request to one instance, two to the other.
            def ask(gateway: str) -> None:
                answer = httpx.post(f"{gateway}/v1/completions", timeout=30, json={
                    "model": labels["model"], "prompt": "scale me", "max_tokens": 4})
                assert answer.status_code == 200, answer.text

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                list(pool.map(ask, [gw_a, gw_b, gw_b]))
            wait_for_value(lambda: query(prom, per_instance),
                           lambda got: len(got) == 2 and all(value(s) > 0 for s in got), 20,
                           "Prometheus to see both gateways' demand", every=0.25)

            at = time.time()  # one instant for every query, so they see the same samples
            shares = query(prom, per_instance, at)
            assert {s["metric"]["instance"] for s in shares} == {
                gw_a.split("//")[1], gw_b.split("//")[1]}
            total = sum(value(s) for s in shares)
            # KEDA's query: exactly one sample (more is an error to KEDA), the instances' sum,
            # above activationThreshold; the replicas it asks for: ceil(sum / threshold).
            [sample] = query(prom, keda, at)
            assert value(sample) == pytest.approx(total) and value(sample) > 0
            assert value(sample) > float(keda_trigger(scaled_object)["metadata"][
                "activationThreshold"])
            threshold = float(keda_trigger(scaled_object)["metadata"]["threshold"])
            assert math.ceil(value(sample) / threshold) >= 1
            # The adapter's: one sample for the HPA's model, pool and role, the same sum.
            [external] = query(prom, adapter, at)
            assert external["metric"] == labels
            assert value(external) == pytest.approx(total)
            # Its discovery (the seriesQuery through /api/v1/series) finds the series.
            found = httpx.get(prom + "/api/v1/series", timeout=10,
                              params={"match[]": adapter_rule()["seriesQuery"]}).json()
            assert found["status"] == "success"
            assert {s["__name__"] for s in found["data"]} == {SIGNAL}
            assert {s["model"] for s in found["data"]} == {labels["model"]}
            # The same through promtool.
            for expr in (keda, adapter):
                [answer] = promtool_query(prom, expr, at)
                assert value(answer) == pytest.approx(total) and value(answer) > 0
