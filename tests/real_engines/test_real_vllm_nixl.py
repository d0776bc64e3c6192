"""Disaggregated prefill/decode on real vLLM with NixlConnector, the connector GPU fleets use:
the prefill engine's answer carries real ``kv_transfer_params`` (its engine id, the blocks
holding the prompt's KV, its side channel), the gateway hands them to the decode engine, and
the decode engine pulls the blocks over NIXL (UCX over TCP on loopback here). Greedy output
equals the prefill engine's own when it serves the request whole.

Opt-in (``GATEWAY_NIXL_TESTS=1``), not part of ``make test``: two more engines, and each
request takes seconds here; with them the suite ran past its time budget on a 2-core VM
(2026-11-27: 27.5 min of suite). Run it with
``GATEWAY_NIXL_TESTS=1 python -m pytest tests/real_engines/test_real_vllm_nixl.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engines import Engine, VllmSpec, nixl_env, vllms
from scrape import by_label, metric_sum
from support import gateway_server, wait_until

pytestmark = pytest.mark.skipif(os.environ.get("GATEWAY_NIXL_TESTS") != "1",
                                reason="opt-in: GATEWAY_NIXL_TESTS=1 (see the module's doc)")

TRANSFERS = "vllm:nixl_xfer_time_seconds_count"  # the decode engine's NIXL reads
NIXL = ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector",
                                            "kv_role": "kv_both"}), "--block-size", "32")


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Engine, Engine, str]]:
    with vllms(tiny_model, VllmSpec(NIXL, env=nixl_env()),
               VllmSpec(NIXL, env=nixl_env())) as (prefill, decode):
        config = {"models": [{"name": "tiny", "tokenizer": str(tiny_model), "replicas": [
            {"url": prefill.url, "engine": "vllm", "name": "prefill", "role": "prefill"},
            {"url": decode.url, "engine": "vllm", "name": "decode", "role": "decode"}]}]}
        with gateway_server(tmp_path_factory.mktemp("gw"), config) as (url, _):
            yield prefill, decode, url


def prompt(k: int) -> str:
    words = "nixl pulls the prompt blocks from the prefill engine".split()
    return f"request {k}: " + " ".join(words[(k + i) % len(words)] for i in range(50 + 3 * k))


def test_the_prefills_kv_transfer_params_take_the_kv_to_the_decode_engine(
        pair: tuple[Engine, Engine, str]) -> None:
    prefill, decode, gateway = pair
    # The wire first: what a prefill answers (the gateway passes it on untouched).
    answer = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt(0), "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    assert {"remote_block_ids", "remote_engine_id", "remote_request_id", "remote_port"} <= set(params)
    before = decode.metric(TRANSFERS)
    for k in range(1, 4):  # each takes seconds here (NIXL's handshake and reads over TCP)
        body = {"model": "tiny", "prompt": prompt(k), "max_tokens": 12, "temperature": 0}
        via = httpx.post(gateway + "/v1/completions", json={**body, "stream": True,
                                                             "return_token_ids": True},
                         timeout=120)
        assert via.status_code == 200 and via.headers["x-gateway-replica"] == "decode"
        ids = [i for line in via.text.split("\n") if line.startswith("data: {")
               for c in json.loads(line[6:])["choices"] for i in c.get("token_ids") or []]
        whole = httpx.post(prefill.url + "/v1/completions", timeout=60,
                           json={**body, "return_token_ids": True}).json()
        assert ids == whole["choices"][0]["token_ids"]  # the prefill engine's own, whole
    wait_until(lambda: decode.metric(TRANSFERS) - before == 3, 10,
               lambda: f"NIXL reads on the decode engine: {decode.metric(TRANSFERS) - before}")
    assert by_label(gateway, "llm_gateway_prefills_total", "outcome").get("ok") == 3
    wait_until(lambda: metric_sum(gateway, "llm_gateway_replica_outstanding_tokens") == 0, 10,
               "every lease returned")
