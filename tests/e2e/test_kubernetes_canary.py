"""deploy/kubernetes/canary: the Argo Rollouts AnalysisTemplate and the Flagger Canary, checked
without a cluster. Each against its CRD's schema (tests/crds, vendored from the projects'
releases; strict: an unknown field fails, as `kubectl apply --validate=strict` would). Then a
real gateway in front of simulated replicas: the AnalysisTemplate's request (its URL and
header with the args filled in) answered by the real endpoint, and its jsonPath evaluated on
that answer by kubectl's JSONPath (client-go's, the one Argo Rollouts uses) yields the
verdict its conditions expect; the Flagger webhook's POST, built as Flagger builds it, gets
200 for a passing canary and 412 for a failing one."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
import yaml

from canary_support import weighted_pools
from crd_support import strict
from support import ROOT, gateway_server, sim

CANARY_DIR = ROOT / "deploy" / "kubernetes" / "canary"
CRDS = ROOT / "tests" / "crds"
MODEL = "llama-3-8b"  # as in the manifests
ADMIN = "canary-k8s-admin-token"
GATE = "canary-k8s-gate-token-0123456789"

assert shutil.which("kubectl"), "run make test (scripts/setup.sh installs kubectl)"


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((CANARY_DIR / name).read_text())


# --- the CRDs' schemas ---

def crd_schema(path: Path, kind: str, version: str) -> dict[str, Any]:
    for crd in yaml.safe_load_all(path.read_text()):
        if crd and crd["spec"]["names"]["kind"] == kind:
            (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
            schema = strict(served["schema"]["openAPIV3Schema"])
            # metadata is checked by the API server itself, not by the CRD
            schema["properties"]["metadata"] = {"type": "object"}
            return schema
    raise AssertionError(f"no CRD of kind {kind} in {path}")


SCHEMAS = {"AnalysisTemplate": (CRDS / "argo-rollouts-analysistemplate.yaml", "v1alpha1"),
           "Canary": (CRDS / "flagger-crds.yaml", "v1beta1")}


def errors(obj: dict[str, Any]) -> list[str]:
    path, version = SCHEMAS[obj["kind"]]
    assert obj["apiVersion"].endswith("/" + version)
    validator = jsonschema.Draft7Validator(crd_schema(path, obj["kind"], version))
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("name", ["analysis-template.yaml", "flagger-canary.yaml"])
def test_each_manifest_matches_its_crd_schema(name: str) -> None:
    obj = manifest(name)
    assert errors(obj) == []
    # The check does reject what a cluster would: a misspelt field, a wrong type.
    misspelt, wrong = copy.deepcopy(obj), copy.deepcopy(obj)
    if obj["kind"] == "AnalysisTemplate":
        metric = misspelt["spec"]["metrics"][0]
        metric["sucessCondition"] = metric.pop("successCondition")
        wrong["spec"]["metrics"][0]["provider"]["web"]["timeoutSeconds"] = "twenty"
    else:
        hook = misspelt["spec"]["analysis"]["webhooks"][0]
        hook["urll"] = hook.pop("url")
        wrong["spec"]["analysis"]["threshold"] = "five"
    assert any("sucessCondition" in e or "urll" in e for e in errors(misspelt)), errors(misspelt)
    assert any("is not of type" in e for e in errors(wrong)), errors(wrong)


# --- against a real gateway ---

@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    """stable and two candidates: `canary` (like the stable engine) and `slow` (30% slower)."""
    paced = ("--profile", "paced", "--ttft-ms", "50", "--itl-ms", "25")
    with sim("vllm", MODEL, 4096, *paced) as stable, sim("vllm", MODEL, 4096, *paced) as like, \
            sim("vllm", MODEL, 4096, *paced, "--slowdown", "1.3") as slow:
        pools = weighted_pools(("stable", 50, stable), ("canary", 25, like), ("slow", 25, slow))
        config = {"models": [{"name": MODEL, "pools": pools}], "health": {"interval": 0.5},
                  "admin_token": ADMIN,
                  "canary": {"gate_token": GATE, "judge": {"min_samples": 30}}}
        with gateway_server(tmp_path_factory.mktemp("k8s-canary"), config) as (url, _):
            def one(i: int) -> None:  # the pools in turn: each sees the same period
                body = {"model": MODEL, "prompt": f"k8s {i}", "max_tokens": 4, "stream": True}
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                                      headers={"x-gateway-pool": ("stable", "canary",
                                                                  "slow")[i % 3]})
                assert response.status_code == 200

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                list(pool.map(one, range(120)))
            yield url


def kubectl_jsonpath(document: dict[str, Any], expression: str, tmp: Path) -> str:
    """``expression`` evaluated on ``document`` by kubectl's JSONPath, offline: kubectl reads
    a local object (``--local``) and prints it through its jsonpath printer. The object needs
    apiVersion, kind and a name, which the gateway's answer does not use."""
    path = tmp / "answer.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                "metadata": {"name": "answer"}, **document}))
    done = subprocess.run(["kubectl", "annotate", "--local", "-f", str(path), "x=y", "-o",
                           f"jsonpath={expression}"], capture_output=True, text=True,
                          timeout=60, env={"KUBECONFIG": "/dev/null", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def condition(expression: str, result: str) -> bool:
    """Argo's success/failure conditions here are `result == "..."`."""
    match = re.fullmatch(r'result == "([^"]*)"', expression.strip())
    assert match, f"not a condition this test reads: {expression}"
    return result == match[1]


@pytest.mark.parametrize("pool,expected", [("canary", "pass"), ("slow", "fail")])
def test_the_analysis_templates_request_and_jsonpath_on_the_real_answer(
        gateway: str, pool: str, expected: str, tmp_path: Path) -> None:
    template = manifest("analysis-template.yaml")
    metric = template["spec"]["metrics"][0]
    web = metric["provider"]["web"]
    args = {a["name"]: a.get("value") for a in template["spec"]["args"]}
    args.update({"model": MODEL, "canary-pool": pool, "gate-token": GATE})

    def fill(text: str) -> str:
        return re.sub(r"\{\{args\.([\w-]+)\}\}", lambda m: args[m[1]], text)

    url = fill(web["url"]).replace("http://llm-gateway.llm.svc.cluster.local", gateway)
    headers = {h["key"]: fill(h["value"]) for h in web["headers"]}
    answer = httpx.get(url, headers=headers, timeout=web["timeoutSeconds"])
    assert answer.status_code == 200, answer.text  # Argo marks any other an error
    result = kubectl_jsonpath(answer.json(), web["jsonPath"], tmp_path)
    assert result == answer.json()["verdict"] == expected
    assert condition(metric["successCondition"], result) == (expected == "pass")
    assert condition(metric["failureCondition"], result) == (expected == "fail")
    # marginal and insufficient data: neither, so Argo counts the measurement inconclusive
    for other in ("marginal", "insufficient data"):
        assert not condition(metric["successCondition"], other)
        assert not condition(metric["failureCondition"], other)


def flagger_call(hook: dict[str, Any]) -> dict[str, Any]:
    """The body Flagger POSTs to a webhook (CanaryWebhookPayload)."""
    return {"name": "engines", "namespace": "llm", "phase": "Progressing",
            "checksum": "6d4f8c", "metadata": hook.get("metadata", {})}


@pytest.mark.parametrize("pool,status", [("canary", 200), ("slow", 412)])
def test_the_flagger_webhook_gets_200_on_pass_and_412_otherwise(gateway: str, pool: str,
                                                                 status: int) -> None:
    (hook,) = manifest("flagger-canary.yaml")["spec"]["analysis"]["webhooks"]
    hook = copy.deepcopy(hook)
    hook["metadata"].update(canary=pool, token=GATE)
    url = hook["url"].replace("http://llm-gateway.llm.svc.cluster.local", gateway)
    answer = httpx.post(url, json=flagger_call(hook), timeout=30)
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["canary"] == pool and body["verdict"] == ("pass" if status == 200 else "fail")
    if status == 412:
        assert "ttft" in body["failed"]


def test_the_gate_refuses_without_a_token_and_opens_nothing_else(gateway: str) -> None:
    url = f"{gateway}/admin/canary/{MODEL}/gate"
    assert httpx.post(url, json=flagger_call({"metadata": {}})).status_code == 401
    wrong = flagger_call({"metadata": {"token": "x" * 32}})
    assert httpx.post(url, json=wrong).status_code == 401
    bearer = {"authorization": f"Bearer {GATE}"}
    assert httpx.post(url + "?canary=canary", headers=bearer).status_code == 200
    assert httpx.get(f"{gateway}/admin/models", headers=bearer).status_code == 401
    bad = flagger_call({"metadata": {"token": GATE, "windw": "60"}})
    answer = httpx.post(url, json=bad)
    assert answer.status_code == 400 and "windw" in answer.text
    bad = flagger_call({"metadata": {"token": GATE, "window": "soon"}})
    assert httpx.post(url, json=bad).status_code == 400
    assert httpx.post(url, content=b"{not json", headers=bearer).status_code == 422
    assert httpx.post(f"{gateway}/admin/canary/nope/gate", headers=bearer).status_code == 404
