"""The canary verdict over a fleet: two real gateway processes sharing a real Redis judge the
same samples (every request, whichever instance served it) and give the same verdict; without
Redis, and with Redis down, a report judges its own instance and says so; the store is
bounded; its entries round-trip."""

from __future__ import annotations

import concurrent.futures
import contextlib
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import redis

from gateway.canary.fleet_samples import decode_pairs, decode_samples, encode
from gateway.canary.samples import PairSample, Sample
from gateway.shared.redis_keys import SharedKeys
from redis_support import SHARED_URL, private_redis, shared_prefix
from scrape import metric_sum
from support import gateway_server, sim, wait_for_value

MODEL = "sim-model"
TOKEN = "fleet-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PACED = ("--profile", "paced", "--ttft-ms", "40", "--itl-ms", "10")


def test_entries_round_trip_once_and_junk_is_skipped() -> None:
    tags: set[str] = set()
    sample = Sample(1000.25, False, 0.0421, 0.0101, 0.5, 99.01)
    failed = Sample(1001.0, True, None, None, None, None)
    pair = PairSample(1002.0, True, True, False, True)
    entries = [encode(sample, "aa", 1), encode(failed, "bb", 1), "junk", "1003 cc 1 x", "",
               encode(sample, "aa", 1),  # a round sent twice (it timed out, yet reached Redis)
               encode(sample, "bb", 2)]  # another instance's
    assert decode_samples(entries, 0, tags) == [sample, failed, sample]
    assert tags == {"aa", "bb"}
    assert decode_samples(entries, 1000.5, set()) == [failed]  # the window
    assert decode_pairs([encode(pair, "dd", 7), "2000 ee 1 10", "x y"], 0, tags) == [pair]
    assert "dd" in tags and "ee" not in tags
    skipped = PairSample(1004.0, True, False, False, False, True)
    assert decode_pairs([encode(skipped, "ff", 8)], 0, set()) == [skipped]
    # An entry written before skipped copies were recorded: four flags, not skipped.
    assert decode_pairs(["1005 gg 9 1101"], 0, set()) == [PairSample(1005.0, True, True, False,
                                                                      True, False)]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[str, str]]:
    with sim("vllm", MODEL, 4096, *PACED) as stable, \
            sim("vllm", MODEL, 4096, *PACED, "--slowdown", "1.3") as canary:
        yield stable, canary


def config(engines: tuple[str, str], redis_url: str | None, prefix: str,
           **judge: object) -> dict:
    stable, canary = engines
    return {"models": [{"name": MODEL, "pools": [
        {"name": "stable", "weight": 50, "replicas": [{"url": stable, "name": "stable-1"}]},
        {"name": "canary", "weight": 50, "replicas": [{"url": canary, "name": "canary-1"}]}]}],
        "health": {"interval": 0.5}, "admin_token": TOKEN, "redis_url": redis_url,
        "redis_key_prefix": prefix,
        "canary": {"samples_sync_interval": 0.2, "judge": {"min_samples": 40, **judge}}}


@contextlib.contextmanager
def two_gateways(tmp: Path, settings: dict) -> Iterator[tuple[str, str]]:
    with gateway_server(tmp, settings) as (one, _), gateway_server(tmp, settings) as (two, _):
        yield one, two


def send(urls: list[str], n: int) -> None:
    """n streamed requests, alternating between the gateways, 8 at a time."""
    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"fleet {i}", "max_tokens": 6, "stream": True}
        with httpx.stream("POST", f"{urls[i % len(urls)]}/v1/completions", json=body,
                          timeout=30) as response:
            assert response.status_code == 200
            response.read()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def verdict(url: str) -> dict:
    response = httpx.get(f"{url}/admin/canary/{MODEL}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def fleet_verdict(url: str, total: int) -> dict:
    """The verdict once the fleet's store holds ``total`` requests (each instance sends its
    samples every 0.2 s)."""
    return wait_for_value(lambda: verdict(url), lambda v: sum(v["requests"].values()) >= total,
                          10, f"{total} requests in the verdict", every=0.1)


def served_here(url: str) -> int:
    """Requests this gateway itself relayed (its own /metrics)."""
    return int(metric_sum(url, "llm_gateway_requests_total"))


def classes(result: dict) -> dict[str, str]:
    return {m["metric"]: m["class"] for m in result["metrics"]}


def test_two_instances_sharing_redis_judge_the_same_fleet_window(engines, tmp_path) -> None:
    with shared_prefix() as prefix, \
            two_gateways(tmp_path, config(engines, SHARED_URL, prefix)) as (one, two):
        send([one, two], 200)
        a, b = fleet_verdict(one, 200), verdict(two)
        assert served_here(one) == served_here(two) == 100  # each served half ...
        assert a["requests"] == b["requests"]  # ... and each judges all of it
        assert sum(a["requests"].values()) == 200
        assert a["samples"]["scope"] == b["samples"]["scope"] == "fleet"
        assert a["samples"]["instances"] == b["samples"]["instances"] == 2
        assert a["verdict"] == b["verdict"] == "fail" and classes(a) == classes(b)
        assert classes(a)["ttft"] == "fail"  # the canary is 30% slower
        medians = lambda r: [m.get("canary_median") for m in r["metrics"]]  # noqa: E731
        assert medians(a) == medians(b)


def test_the_store_is_bounded_per_pool(engines, tmp_path) -> None:
    with shared_prefix() as prefix, \
            gateway_server(tmp_path, config(engines, SHARED_URL, prefix,
                                            fleet_samples_per_pool=30)) as (url, _):
        send([url], 100)
        result = verdict(url)
        assert result["requests"] == {"baseline": 30, "canary": 30}
        client = redis.Redis.from_url(SHARED_URL)
        keys = SharedKeys(prefix)
        assert client.llen(keys.canary_samples(MODEL, "stable")) == 30
        assert client.llen(keys.canary_samples(MODEL, "canary")) == 30
        client.close()


def test_without_redis_a_report_judges_its_instance_and_says_so(engines, tmp_path) -> None:
    with two_gateways(tmp_path, config(engines, None, "unused:")) as (one, two):
        send([one, two], 60)
        a = verdict(one)
        assert sum(a["requests"].values()) == served_here(one) == 30
        assert a["samples"] == {"scope": "instance", "instances": 1,
                                "note": "no redis_url: this instance's requests only"}


def test_redis_down_falls_back_to_the_instance_and_comes_back(engines, tmp_path) -> None:
    with private_redis(tmp_path) as server, \
            two_gateways(tmp_path, config(engines, server.url, "fleet:")) as (one, two):
        send([one, two], 40)
        assert sum(fleet_verdict(one, 40)["requests"].values()) == 40
        server.kill()
        send([one, two], 40)
        down = verdict(one)
        assert down["samples"]["scope"] == "instance" and down["samples"]["fallback"]
        assert "Redis unreachable" in down["samples"]["note"]
        assert sum(down["requests"].values()) == served_here(one) == 40
        server.start()  # empty: the instances send what they held since
        back = wait_for_value(lambda: verdict(two),
                              lambda v: v["samples"]["scope"] == "fleet"
                              and sum(v["requests"].values()) >= 40,
                              20, "fleet samples of 40 requests", every=0.3)
        # Queued while Redis was away: both instances' requests of the outage are there.
        assert back["samples"]["instances"] == 2 and sum(back["requests"].values()) == 40
