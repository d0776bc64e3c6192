"""Canary splits: sticky by key (weighted rendezvous hashing), forced pools, weights changed
at run time and shared through Redis. Unit tests of the split, then real gateways in front
of simulated replicas."""

from __future__ import annotations

import random
import re
from typing import Iterator

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from text_generation import Client as TGIClient
from text_generation.errors import ValidationError as TGIValidationError

from gateway.balance.pool_split import PoolSplit, rendezvous, sticky_key
from gateway.config import ConfigError, load_settings
from gateway.fleet.model import Pool
from gateway.fleet.replica import Replica
from gateway.protocol.errors import Api
from gateway.protocol.request import Caller, Context, GenerationRequest
from routing import Routing
from redis_support import SHARED_URL, shared_prefix
from support import gateway_server, sim, wait_until, wait_until_async

MODEL = "sim-model"
TOKEN = "canary-admin-token"
FAST = ("--profile", "instant")


# --- the split itself ---

def _pools(stable: float, canary: float) -> list[Pool]:
    return [Pool("stable", stable, [Replica("s1", "http://s1", "vllm", MODEL, "stable")]),
            Pool("canary", canary, [Replica("c1", "http://c1", "vllm", MODEL, "canary")])]


KEYS = [f"session-{i}" for i in range(1000)]


def test_thousand_keys_split_by_weight() -> None:
    pools = _pools(90, 10)
    canary = sum(rendezvous(pools, key).name == "canary" for key in KEYS)
    assert 70 <= canary <= 130, canary  # 10% of 1,000, within 3 points


def test_weight_change_moves_keys_only_into_the_canary() -> None:
    pools = _pools(90, 10)
    before = {key: rendezvous(pools, key).name for key in KEYS}
    pools[0].weight, pools[1].weight = 80, 20
    after = {key: rendezvous(pools, key).name for key in KEYS}
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved and all(before[k] == "stable" and after[k] == "canary" for k in moved)
    assert 170 <= sum(p == "canary" for p in after.values()) <= 230
    pools[1].weight = 0  # rolled back: every key home
    assert all(rendezvous(pools, key).name == "stable" for key in KEYS)


def test_sticky_pool_without_eligible_replica_falls_back() -> None:
    pools = _pools(50, 50)
    split = PoolSplit(rng=random.Random(1))
    home = {key: rendezvous(pools, key) for key in KEYS[:50]}
    only_stable = {id(pools[0].replicas[0])}
    for key, pool in home.items():
        assert split.pick(pools, {id(r) for p in pools for r in p.replicas}, key) is pool
        assert split.pick(pools, only_stable, key) is pools[0]


async def test_sticky_key_waits_for_its_full_pool_instead_of_leaving_it() -> None:
    """Saturation must not move a session to the other engine: its request queues for a
    slot in its own pool while the other pool has room."""
    import asyncio

    from gateway.balance.policy import make_policy
    from gateway.balance.ledger import InProcessLedger
    from gateway.config import BackpressureConfig
    from gateway.fleet.model import ServedModel
    from gateway.protocol.openai import parse_completion

    pools = _pools(50, 50)
    for r in (r for p in pools for r in p.replicas):
        r.max_model_len = 4096
    router = Routing({MODEL: ServedModel(MODEL, pools, None, 4096, 16)},
                     make_policy("least_outstanding_tokens"), InProcessLedger(),
                     BackpressureConfig(max_in_flight_per_replica=1, queue_timeout=5))
    model, admission = router.admit(parse_completion(
        b'{"model": "sim-model", "prompt": "hi", "max_tokens": 8}'))
    key = next(k for k in KEYS if rendezvous(pools, k).name == "stable")
    first = await router.place(model, admission, key=key)
    assert first.replica.pool == "stable"
    waiting = asyncio.create_task(router.place(model, admission, key=key))
    await wait_until_async(lambda: router.queued(MODEL) == 1, 5, "the keyed request queued",
                           every=0.001)
    assert not waiting.done()  # the canary replica is free, yet the key waits for stable
    first.lease.close()
    second = await asyncio.wait_for(waiting, 1)
    assert second.replica is first.replica and second.queued_for > 0
    second.lease.close()
    other = await router.place(model, admission)  # no key: any pool with room
    other.lease.close()


def test_no_key_draws_by_weight() -> None:
    pools = _pools(90, 10)
    split = PoolSplit(rng=random.Random(7))
    eligible = {id(r) for p in pools for r in p.replicas}
    canary = sum(split.pick(pools, eligible, None).name == "canary" for _ in range(2000))
    assert 140 <= canary <= 260, canary


def _request(body: dict, session: str | None = None,
             caller: str | None = None) -> tuple[GenerationRequest, Context]:
    return (GenerationRequest(Api.OPENAI, "/v1/completions", body, b"", MODEL, False, 1),
            Context(session=session, caller=Caller(caller) if caller else None))


def test_sticky_key_order() -> None:
    assert sticky_key(*_request({"user": "u"}, session="s", caller="k")) == "s"
    assert sticky_key(*_request({"user": "u"}, caller="k")) == "u"
    assert sticky_key(*_request({"user": 5}, caller="k")) == "k"
    assert sticky_key(*_request({})) is None


@pytest.mark.parametrize("pools, message", [
    ([{"name": "a"}, {"name": "b", "shadow_of": "nope"}], "is not another pool"),
    ([{"name": "a"}, {"name": "b", "shadow_of": "b"}], "is not another pool"),
    ([{"name": "a"}, {"name": "b", "shadow_of": "a"}, {"name": "c", "shadow_of": "b"}],
     "no chains"),
    ([{"name": "a"}, {"name": "b", "shadow_of": "a", "sample": 1.5}], "sample"),
])
def test_shadow_config_is_validated(pools: list[dict], message: str) -> None:
    replicas = [{"url": "http://127.0.0.1:9"}]
    config = [{"name": MODEL, "pools": [{**p, "replicas": replicas} for p in pools]}]
    with pytest.raises(ConfigError, match=message):
        load_settings(models=config)


# --- real gateways ---

@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    with sim("vllm", MODEL, 4096, *FAST) as stable, sim("vllm", MODEL, 4096, *FAST) as canary:
        yield stable, canary


def _config(replicas: tuple[str, str], **settings: object) -> dict:
    stable, canary = replicas
    return {"models": [{"name": MODEL, "pools": [
        {"name": "stable", "weight": 90, "replicas": [{"url": stable, "name": "stable-1"}]},
        {"name": "canary", "weight": 10, "replicas": [{"url": canary, "name": "canary-1"}]}]}],
        "health": {"interval": 0.5}, "admin_token": TOKEN, **settings}


@pytest.fixture(scope="module")
def two_gateways(replicas, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Two instances sharing one Redis (a key prefix of their own), weights 90/10."""
    tmp = tmp_path_factory.mktemp("split")
    with shared_prefix() as prefix:
        config = _config(replicas, redis_url=SHARED_URL, redis_key_prefix=prefix,
                         canary={"weights_sync_interval": 0.2})
        with gateway_server(tmp, config) as (a, _), gateway_server(tmp, config) as (b, _):
            yield a, b


def _pool_of(client: httpx.Client, url: str, headers: dict | None = None,
             body: dict | None = None) -> str:
    response = client.post(url + "/v1/completions", headers=headers or {}, json={
        "model": MODEL, "prompt": "hello", "max_tokens": 1, **(body or {})})
    assert response.status_code == 200, response.text
    return response.headers["x-gateway-pool"]


def _weights(url: str) -> dict[str, float]:
    models = httpx.get(url + "/admin/models", headers={"authorization": f"Bearer {TOKEN}"}).json()
    return {p["pool"]: p["weight"] for p in models["models"][0]["pools"]}


def _set_weight(url: str, pool: str, weight: float) -> httpx.Response:
    return httpx.put(f"{url}/admin/models/{MODEL}/pools/{pool}", json={"weight": weight},
                     headers={"authorization": f"Bearer {TOKEN}"})


def _wait_weights(url: str, expected: dict[str, float], timeout: float = 10.0) -> None:
    wait_until(lambda: _weights(url) == expected, timeout,
               lambda: f"{url} weights {_weights(url)} != {expected}")


def test_thousand_sessions_split_90_10_through_the_gateway(two_gateways) -> None:
    a, _ = two_gateways
    with httpx.Client(timeout=10) as client:
        pools = [_pool_of(client, a, {"x-session-id": key}) for key in KEYS]
    canary = pools.count("canary")
    assert 70 <= canary <= 130, canary
    assert canary == sum(rendezvous(_pools(90, 10), key).name == "canary" for key in KEYS)


def test_key_stays_in_its_pool_over_requests_and_instances(two_gateways) -> None:
    a, b = two_gateways
    keys = [f"sticky-{i}" for i in range(40)]
    clients = [openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
               for url in (a, b)]
    with httpx.Client(timeout=10) as client:
        for key in keys:
            seen = {_pool_of(client, (a, b)[i % 2], {"x-session-id": key}) for i in range(10)}
            for oai in clients:  # the OpenAI `user` field, from the real client
                raw = oai.completions.with_raw_response.create(model=MODEL, prompt="hi",
                                                               max_tokens=1, user=key)
                seen.add(raw.headers["x-gateway-pool"])
            assert len(seen) == 1, (key, seen)
        homes = {_pool_of(client, a, {"x-session-id": key}) for key in keys}
    assert homes == {"stable", "canary"}  # both pools hold some of the 40 keys


def test_runtime_weight_is_shared_and_moves_keys_only_into_the_canary(two_gateways) -> None:
    a, b = two_gateways
    keys = [f"move-{i}" for i in range(300)]
    with httpx.Client(timeout=10) as client:
        before = {key: _pool_of(client, b, {"x-session-id": key}) for key in keys}
        try:
            assert _set_weight(a, "stable", 80).status_code == 200
            assert _set_weight(a, "canary", 20).status_code == 200
            _wait_weights(b, {"stable": 80, "canary": 20})  # set on A, adopted by B
            after = {key: _pool_of(client, b, {"x-session-id": key}) for key in keys}
            metrics = httpx.get(b + "/metrics").text
            assert re.search(r'llm_gateway_pool_weight\{model="sim-model",pool="canary"\} 20\.0',
                             metrics)
        finally:
            _set_weight(a, "stable", 90)
            _set_weight(a, "canary", 10)
        _wait_weights(b, {"stable": 90, "canary": 10})
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "stable" and after[k] == "canary" for k in moved)
    assert list(after.values()).count("canary") > list(before.values()).count("canary")


def test_admin_weight_errors(two_gateways) -> None:
    a, _ = two_gateways
    assert _set_weight(a, "nope", 5).status_code == 404
    assert _set_weight(a, "canary", -1).status_code == 422
    assert httpx.put(f"{a}/admin/models/{MODEL}/pools/canary", json={"weight": 5}).status_code == 401
    assert _weights(a) == {"stable": 90, "canary": 10}


def test_forced_pool_and_unknown_pool(two_gateways) -> None:
    a, _ = two_gateways
    with httpx.Client(timeout=10) as client:
        for key in KEYS[:30]:
            assert _pool_of(client, a, {"x-session-id": key, "x-gateway-pool": "canary"}) == "canary"
    oai = openai.OpenAI(base_url=a + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                               extra_headers={"x-gateway-pool": "nope"})
    assert caught.value.status_code == 400
    assert "no pool named `nope`" in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"
    tgi = TGIClient(a, headers={"x-gateway-pool": "nope"}, timeout=10)
    with pytest.raises(TGIValidationError, match="no pool named `nope`"):
        tgi.generate("hi", max_new_tokens=1)
    raw = httpx.post(a + "/generate", headers={"x-gateway-pool": "x" * 5000},
                     json={"inputs": "hi", "parameters": {"max_new_tokens": 1}})
    assert raw.status_code == 400 and raw.json()["error_type"] == "validation"
    assert TGIClient(a, headers={"x-gateway-pool": "stable"}).generate(
        "hi", max_new_tokens=1).generated_text


def test_pool_header_can_be_disabled(replicas, tmp_path) -> None:
    config = _config(replicas, canary={"allow_pool_header": False})
    with gateway_server(tmp_path, config) as (url, _), httpx.Client(timeout=10) as client:
        key = next(k for k in KEYS if rendezvous(_pools(90, 10), k).name == "stable")
        assert _pool_of(client, url, {"x-session-id": key, "x-gateway-pool": "canary"}) == "stable"
        assert _pool_of(client, url, {"x-gateway-pool": "nope"}) in ("stable", "canary")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Any value a header may carry (visible ASCII and spaces: the HTTP parser itself refuses
# control characters with its own 400, before the gateway sees the request).
@given(value=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1,
                     max_size=300).map(str.encode),
       route=st.sampled_from(["/v1/completions", "/generate"]))
def test_any_pool_header_is_a_pool_or_a_clean_400(two_gateways, value: bytes, route: str) -> None:
    a, _ = two_gateways
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 1} if route == "/v1/completions"
            else {"inputs": "hi", "parameters": {"max_new_tokens": 1}})
    try:
        response = httpx.post(a + route, json=body, headers=[(b"x-gateway-pool", value)])
    except httpx.LocalProtocolError:
        return  # a value the client itself refuses to send
    if value.strip() in (b"stable", b"canary", b""):  # a pool, or no header at all
        assert response.status_code == 200
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "no pool named" in (error["message"] if route == "/v1/completions" else error)


async def test_weight_set_while_redis_is_away_is_published_when_it_is_back() -> None:
    """Fail-open: a weight set while Redis cannot be reached applies here at once, stays
    pending, and reaches Redis (and so the other instances) at the first good round; a weight
    another instance wrote is adopted; another configuration's pools are left alone."""
    from redis.asyncio import Redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    from gateway.canary.weights import PoolWeights
    from gateway.fleet.model import ServedModel
    from gateway.shared.redis_keys import SharedKeys
    from gateway.shared.sync import connect
    from support import free_port

    model = ServedModel(MODEL, _pools(90, 10), None, None, 16)
    seen: list[tuple[str, str, float]] = []
    weights = PoolWeights({MODEL: model}, on_change=lambda m, p, w: seen.append((m, p, w)))
    with shared_prefix() as prefix:
        keys = SharedKeys(prefix)
        away = connect(f"redis://127.0.0.1:{free_port()}/0", 0.5)
        weights.share(away, keys, 0.2)
        weights.set_weight(MODEL, "canary", 0)
        assert model.pools[1].weight == 0 and seen[-1] == (MODEL, "canary", 0)
        with pytest.raises(RedisConnectionError):
            await weights.sync()
        await away.aclose()
        redis: Redis = connect(SHARED_URL, 2.0)
        try:
            weights.share(redis, keys, 0.2)
            await redis.hset(keys.canary_weights, mapping={f"{MODEL}\tstable": "70",
                                                           "other-model\tx": "5"})
            await weights.sync()
            assert await redis.hgetall(keys.canary_weights) == {
                f"{MODEL}\tcanary": "0", f"{MODEL}\tstable": "70", "other-model\tx": "5"}
            assert [p.weight for p in model.pools] == [70, 0]
        finally:
            await redis.aclose()
    with pytest.raises(KeyError):
        weights.set_weight(MODEL, "nope", 1)
    with pytest.raises(ValueError):
        weights.set_weight(MODEL, "canary", float("nan"))


def test_api_key_name_is_the_sticky_key_of_last_resort(replicas, tmp_path) -> None:
    """With API keys on, a client that sends neither a session nor `user` stays in the pool
    its key's name hashes to."""
    from access_support import key

    names = [f"team-{i}" for i in range(12)]
    config = _config(replicas, auth={"keys": [key(n, f"secret-{n}") for n in names]})
    with gateway_server(tmp_path, config) as (url, _), httpx.Client(timeout=10) as client:
        for name in names:
            auth = {"authorization": f"Bearer secret-{name}"}
            seen = {_pool_of(client, url, auth) for _ in range(5)}
            assert seen == {rendezvous(_pools(90, 10), name).name}, (name, seen)
    assert {rendezvous(_pools(90, 10), n).name for n in names} == {"stable", "canary"}
