"""The Responses API through the gateway to simulated vLLM replicas, each of which keeps its
stored responses in its own process: every turn that continues a response, and every read of
one, reaches the replica that stored it; one instance remembers that in process, several
share it through Redis; an unknown response or a replica gone is a 404 in OpenAI's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from redis_support import SHARED_URL, shared_prefix
from scrape import samples
from support import gateway_server, sim

TOKEN = "t" * 24


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    with sim("vllm", "m", 4096) as a, sim("vllm", "m", 4096) as b:
        yield [a, b]


def _config(replicas: list[str], **extra: Any) -> dict[str, Any]:
    return {"models": [{"name": "m", "replicas": [{"url": u, "name": n}
                                                   for u, n in zip(replicas, "ab")]}],
            "balancer": "round_robin", "admin_token": TOKEN, **extra}


def _turn(gateway: str, text: str, previous: str | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "m", "input": text, "max_output_tokens": 6, **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    return httpx.post(f"{gateway}/v1/responses", json=body, timeout=30)


def _streamed_turn(gateway: str, text: str, previous: str) -> tuple[str, str]:
    """(the replica, the stored id) of a streamed turn."""
    body = {"model": "m", "input": text, "stream": True, "previous_response_id": previous}
    with httpx.stream("POST", f"{gateway}/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        data = r.read().decode()
    assert data.rstrip().split("\n")[-2] == "event: response.completed"  # ends whole
    created = next(line for line in data.split("\n") if '"response.created"' in line)
    return r.headers["x-gateway-replica"], httpx.Response(200, content=created[6:]).json()[
        "response"]["id"]


def _conversations(gateway: str, count: int = 6) -> list[tuple[str, str]]:
    """``count`` three-turn conversations (the last turn streamed); (replica, last id) each."""
    out = []
    for i in range(count):
        first = _turn(gateway, f"conversation {i}")
        assert first.status_code == 200, first.text
        home, previous = first.headers["x-gateway-replica"], first.json()["id"]
        second = _turn(gateway, "and then?", previous)
        assert second.status_code == 200, second.text
        assert second.headers["x-gateway-replica"] == home
        assert second.json()["previous_response_id"] == previous
        replica, last = _streamed_turn(gateway, "and last?", second.json()["id"])
        assert replica == home
        out.append((home, last))
    return out


def test_each_conversation_stays_on_the_replica_that_stored_it(replicas: list[str],
                                                               tmp_path: Path) -> None:
    with gateway_server(tmp_path, _config(replicas)) as (gateway, _):
        done = _conversations(gateway)
        assert {home for home, _ in done} == {"a", "b"}  # round robin spread the first turns
        home, last = done[0]
        through = httpx.get(f"{gateway}/v1/responses/{last}")
        direct = httpx.get(f"{replicas['ab'.index(home)]}/v1/responses/{last}")
        assert through.status_code == direct.status_code == 200
        assert through.json() == direct.json() and through.headers["x-gateway-replica"] == home

        for r in (_turn(gateway, "x", "resp_unknown"), httpx.get(f"{gateway}/v1/responses/nope")):
            assert r.status_code == 404, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["code"] == "response_not_found"
        not_stored = _turn(gateway, "forget me", store=False)
        assert not_stored.status_code == 200
        assert _turn(gateway, "x", not_stored.json()["id"]).status_code == 404

        # The replica that stored it leaves the fleet: its responses are a 404, not another
        # replica's answer.
        httpx.delete(f"{gateway}/admin/replicas/{home}",
                     headers={"authorization": f"Bearer {TOKEN}"}).raise_for_status()
        gone = _turn(gateway, "still there?", last)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
        assert httpx.get(f"{gateway}/v1/responses/{last}").status_code == 404

        load = [v for n, _, v in samples(gateway) if n in (
            "llm_gateway_replica_outstanding_tokens", "llm_gateway_replica_in_flight_requests")]
        assert not any(load)


def test_bad_responses_requests_are_4xx(replicas: list[str], tmp_path: Path) -> None:
    with gateway_server(tmp_path, _config(replicas)) as (gateway, _):
        for body, param in (({"model": "m"}, "input"), ({"model": "m", "input": 3}, "input"),
                            ({"model": "m", "input": "x", "previous_response_id": 5},
                             "previous_response_id"),
                            ({"model": "m", "input": "x", "max_output_tokens": 0},
                             "max_output_tokens"),
                            ({"model": "m", "input": [1]}, "input")):
            r = httpx.post(f"{gateway}/v1/responses", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param


def test_instances_sharing_redis_find_each_others_responses(replicas: list[str],
                                                            tmp_path: Path) -> None:
    with shared_prefix() as prefix:
        config = _config(replicas, redis_url=SHARED_URL, redis_key_prefix=prefix)
        with gateway_server(tmp_path, config) as (one, _), \
                gateway_server(tmp_path, config) as (two, _):
            for i in range(4):
                first = _turn(one, f"shared {i}")
                assert first.status_code == 200
                home = first.headers["x-gateway-replica"]
                second = _turn(two, "continued elsewhere", first.json()["id"])
                assert second.status_code == 200, second.text
                assert second.headers["x-gateway-replica"] == home
                for gateway in (one, two):  # each reads what the other recorded
                    read = httpx.get(f"{gateway}/v1/responses/{second.json()['id']}")
                    assert read.status_code == 200 and read.headers["x-gateway-replica"] == home
