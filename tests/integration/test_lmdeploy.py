"""A new engine is one module and one registry line: LMDeploy (``gateway/engines/lmdeploy.py``)
behind the gateway, against a simulated ``lmdeploy serve api_server``. OpenAI clients pass
through; a TGI client is translated to its /v1/completions within what LMDeploy takes, and
refused (422, naming why) where it cannot be served exactly; its load is read from its own
``lmdeploy:`` gauges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import text_generation
import text_generation.errors as tgi_errors

from support import gateway_server, sim, wait_until

MODEL = "sim-model"
PROMPT = "Tell me about the gateway"


@pytest.fixture(scope="module")
def lmdeploy(tmp_path_factory: pytest.TempPathFactory,
             model_dir: Path) -> Iterator[tuple[str, str]]:
    """(gateway URL, replica URL): one simulated LMDeploy replica behind a gateway."""
    with sim("lmdeploy", MODEL, 4096, "--tokenizer", str(model_dir), "--profile", "paced",
             "--ttft-ms", "2", "--itl-ms", "1") as replica:
        config = {"models": [{"name": MODEL, "tokenizer": str(model_dir), "max_model_len": 1024,
                              "replicas": [{"url": replica, "engine": "lmdeploy", "name": "lmd"}]}],
                  "health": {"interval": 0.5, "timeout": 1.0}, "admin_token": "t",
                  "scheduling": {"signals_interval": 0.2}}
        with gateway_server(tmp_path_factory.mktemp("lmdeploy"), config) as (url, _):
            yield url, replica


def test_the_simulated_replica_answers_as_lmdeploy(lmdeploy: tuple[str, str]) -> None:
    _, replica = lmdeploy
    card = httpx.get(replica + "/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["owned_by"] == "lmdeploy" and card["parent"] is None
    assert "max_model_len" not in card  # LMDeploy's cards carry no window
    metrics = httpx.get(replica + "/metrics").text
    for name in ("lmdeploy:num_requests_running{", "lmdeploy:num_requests_waiting{",
                 "lmdeploy:gpu_cache_usage_perc{"):
        assert name in metrics


def test_openai_clients_pass_through(lmdeploy: tuple[str, str]) -> None:
    url, _ = lmdeploy
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    chat = client.chat.completions.create(model=MODEL, max_tokens=4,
                                          messages=[{"role": "user", "content": PROMPT}])
    assert chat.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=3, stream=True, messages=[{"role": "user", "content": PROMPT}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_tgi_client_is_translated_within_what_lmdeploy_takes(lmdeploy: tuple[str, str]) -> None:
    url, _ = lmdeploy
    reply = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "top_k": 5, "repetition_penalty": 1.1, "seed": 3}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["generated_text"] and reply.headers["x-generated-tokens"] == "4"
    # TGI's stream events and details need token ids, which LMDeploy does not report (the
    # text_generation client always asks for details); a frequency penalty it does not take:
    # refused, never served inexactly.
    client = text_generation.Client(url, timeout=30)
    with pytest.raises(tgi_errors.ValidationError, match="streaming from lmdeploy"):
        list(client.generate_stream(PROMPT, max_new_tokens=4))
    with pytest.raises(tgi_errors.ValidationError, match="`details`"):
        client.generate(PROMPT, max_new_tokens=4)
    reply = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "frequency_penalty": 0.5}})
    assert reply.status_code == 422 and "`frequency_penalty`" in reply.json()["error"]


def test_its_load_is_read_from_its_own_gauges(lmdeploy: tuple[str, str]) -> None:
    url, _ = lmdeploy

    def signals() -> object:
        replicas = httpx.get(url + "/admin/replicas",
                             headers={"authorization": "Bearer t"}).json()["replicas"]
        return replicas[0]["engine_signals"]

    # Idle once a scrape follows the earlier tests' last request (one may still show it).
    wait_until(lambda: (s := signals()) and s["running"] == 0 and s["waiting"] == 0,
               what=lambda: f"a scrape of the replica's idle lmdeploy: gauges: {signals()}")
    assert signals()["kv_usage"] is not None
