"""Many model names per engine: two model entries listing the same replicas, an engine alias
and a LoRA adapter on one replica only, through the gateway to simulated vLLM replicas that
check the names they are sent. One replica is one ledger entry whatever name a request used."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.config import load_settings
from gateway.fleet.membership import Fleet
from gateway.fleet.model import build_models
from scrape import by_label, samples
from support import gateway_server, sim, wait_until

BASE = "base"


def _settings(*models: dict) -> dict:
    return {"models": list(models), "balancer": "round_robin"}


def test_a_replica_listed_under_two_models_is_one_replica() -> None:
    replicas = [{"url": "http://10.0.0.1:8000"}, {"url": "http://10.0.0.2:8000"}]
    settings = load_settings(**_settings({"name": "a", "replicas": replicas},
                                         {"name": "b", "aliases": ["b2"], "replicas": replicas}))
    models = build_models(settings)
    assert models["a"].replicas[0] is models["b"].replicas[0]
    assert len(Fleet(models).replicas) == 2
    assert models["b"].names == ("b", "b2")


@pytest.mark.parametrize("second", [{"url": "http://10.0.0.1:8000", "engine": "tgi"},
                                    {"url": "http://10.0.0.9:8000", "name": "r1"}])
def test_one_name_for_two_different_engines_is_refused(second: dict) -> None:
    settings = load_settings(**_settings(
        {"name": "a", "replicas": [{"url": "http://10.0.0.1:8000", "name": "r1"}]},
        {"name": "b", "replicas": [{**second, "name": "r1"}]}))
    with pytest.raises(ValueError, match="listed twice with a different"):
        build_models(settings)


def test_a_name_given_to_two_models_is_refused() -> None:
    replicas = [{"url": "http://10.0.0.1:8000"}]
    with pytest.raises(ValueError, match="unique across models"):
        load_settings(**_settings({"name": "a", "aliases": ["x"], "replicas": replicas},
                                  {"name": "x", "replicas": replicas}))


def _complete(gateway: str, model: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/completions", timeout=30,
                      json={"model": model, "prompt": "hello there", "max_tokens": max_tokens})


def test_names_aliases_and_an_adapter_share_each_replicas_ledger(tmp_path: Path) -> None:
    with sim("vllm", BASE, 4096, "--alias", "base-alias", "--lora-modules", "sql=/adapters/sql",
             "--speed", "50") as with_adapter, \
            sim("vllm", BASE, 4096, "--alias", "base-alias", "--speed", "50") as plain:
        replicas = [{"url": with_adapter, "name": "a"}, {"url": plain, "name": "b"}]
        config = _settings({"name": BASE, "replicas": replicas},
                           {"name": "base-alias", "discover_names": False, "replicas": replicas})
        with gateway_server(tmp_path, config) as (gateway, _):
            listed = httpx.get(f"{gateway}/v1/models").json()["data"]
            assert {(m["id"], m["parent"]) for m in listed} == {
                (BASE, None), ("base-alias", None), ("sql", BASE)}

            with ThreadPoolExecutor(8) as pool:
                asked = ["sql"] * 16 + [BASE] * 8 + ["base-alias"] * 8
                answers = list(pool.map(lambda name: (name, _complete(gateway, name)), asked))
            where: dict[str, Counter] = {}
            for name, answer in answers:
                assert answer.status_code == 200, answer.text
                # forwarded as asked; vLLM answers an alias under its first served name
                assert answer.json()["model"] == (BASE if name == "base-alias" else name)
                where.setdefault(name, Counter())[answer.headers["x-gateway-replica"]] += 1
            assert where["sql"] == Counter({"a": 16})  # only where the adapter is
            assert set(where[BASE]) == set(where["base-alias"]) == {"a", "b"}

            # One ledger entry per engine, back to zero; requests labelled by the name asked
            # and the base they ran on.
            series = [(labels["replica"], value) for name, labels, value in samples(gateway)
                      if name == "llm_gateway_replica_outstanding_tokens"]
            assert sorted(series) == [("a", 0.0), ("b", 0.0)]
            assert by_label(gateway, "llm_gateway_requests_total", "model", status="2xx") == {
                "sql": 16, BASE: 8, "base-alias": 8}
            assert by_label(gateway, "llm_gateway_requests_total", "base", model="sql",
                            status="2xx") == {BASE: 16}

            unknown = _complete(gateway, "no-such-adapter")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "model_not_found"


def _stream(gateway: str, model: str, tokens: int) -> None:
    with httpx.stream("POST", f"{gateway}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hi", "max_tokens": tokens,
                            "stream": True}) as response:
        assert response.status_code == 200
        response.read()


def test_adapter_requests_go_where_the_engine_runs_it_or_has_a_slot(tmp_path: Path) -> None:
    paced = ("--profile", "paced", "--ttft-ms", "5", "--itl-ms", "100", "--max-loras", "1")
    with sim("vllm", BASE, 4096, "--lora-modules", "sql", *paced) as a, \
            sim("vllm", BASE, 4096, "--lora-modules", "sql", "other", *paced) as b:
        config = {**_settings({"name": BASE, "replicas": [{"url": a, "name": "a"},
                                                            {"url": b, "name": "b"}]}),
                  "scheduling": {"signals_interval": 0.1, "signals_max_age": 30}}
        with gateway_server(tmp_path, config) as (gateway, _), ThreadPoolExecutor(8) as pool:
            # b's only adapter slot is taken by `other` for about 8 s ...
            busy = [pool.submit(_stream, gateway, "other", 80) for _ in range(2)]
            wait_until(lambda: "other" in httpx.get(f"{b}/metrics").text.split(
                "running_lora_adapters=\"")[-1].split('"')[0], 10, "b running `other`")
            # the gateway's next scrape of b sees it (and b's running count with it)
            wait_until(lambda: by_label(gateway, "llm_gateway_engine_running_requests",
                                        "replica").get("b", 0) >= 1, 10,
                       "the gateway's scrape of b running `other`")
            # ... so round robin or not, `sql` goes to a, which has a free slot.
            where = Counter(_complete(gateway, "sql", 1).headers["x-gateway-replica"]
                            for _ in range(6))
            assert where == Counter({"a": 6})
            # TGI's adapter_id is the adapter's model name on vLLM: only b serves `other`.
            tgi = httpx.post(f"{gateway}/generate", timeout=30, json={
                "inputs": "hi", "parameters": {"max_new_tokens": 3, "adapter_id": "other"}})
            assert tgi.status_code == 200, tgi.text
            assert tgi.headers["x-gateway-replica"] == "b"
            for future in busy:
                future.result()


def test_an_adapter_is_loaded_at_run_time_once_and_remembered(tmp_path: Path) -> None:
    with sim("vllm", BASE, 4096, "--allow-runtime-lora", "--speed", "50") as a, \
            sim("vllm", BASE, 4096, "--allow-runtime-lora", "--speed", "50") as b:
        config = _settings({"name": BASE, "load_adapters": {"fin": "/adapters/fin"},
                            "replicas": [{"url": a, "name": "a"}, {"url": b, "name": "b"}]})
        with gateway_server(tmp_path, config) as (gateway, _):
            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda _: _complete(gateway, "fin"), range(6)))
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
            homes = {r.headers["x-gateway-replica"] for r in answers}
            assert len(homes) == 1  # loaded once, on one replica, and sent there since
            engines = {name: [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
                       for name, url in (("a", a), ("b", b))}
            assert [name for name, ids in engines.items() if "fin" in ids] == list(homes)
            listed = {m["id"]: m["parent"] for m in httpx.get(f"{gateway}/v1/models").json()["data"]}
            assert listed["fin"] == BASE
            # a name that is neither served nor loadable stays a 404
            assert _complete(gateway, "not-configured").status_code == 404
