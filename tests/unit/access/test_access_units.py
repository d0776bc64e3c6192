"""Access control as pure logic: secrets and bearer parsing, buckets with a fake clock, the
grant's settlement, the headers' format, the config's checks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.access.control import AccessControl
from gateway.access.errors import InvalidApiKey, ModelNotAllowed, RateLimited
from gateway.access.keys import ApiKey
from gateway.access.limits import LocalLimiter, duration
from gateway.access.secret import bearer, hash_secret, new_secret
from gateway.config import AuthConfig, ConfigError, KeyLimits, load_settings
from gateway.protocol.request import Caller
from gateway.protocol.usage import Usage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def api_key(**limits: int) -> ApiKey:
    return ApiKey("k", hash_secret("s"), None, 1.0, KeyLimits(**limits))


def test_secrets_and_bearer() -> None:
    secret = new_secret()
    assert secret.startswith("sk-gw-") and len(secret) > 40 and new_secret() != secret
    assert hash_secret("abc") == ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    assert bearer(b"Bearer tok") == b"tok" and bearer(b"bearer  tok ") == b"tok"
    for bad in (None, b"", b"Bearer", b"Basic tok", b"tok", b"Bearer " + b"x" * 600):
        assert bearer(bad) is None


def test_token_bucket_reserves_settles_and_refills() -> None:
    clock = Clock()
    limiter, key = LocalLimiter(6.0, clock), api_key(tokens_per_minute=600)
    first = limiter.acquire_now(key, 500)
    assert first.why == "" and first.tokens_left == 100
    refused = limiter.acquire_now(key, 200)
    assert refused.why == "tokens" and refused.retry_after == pytest.approx(1.0)  # 100/100 per s
    limiter.release(key, first.lease, 450)  # used 50 of 500: 450 back at once
    assert limiter.acquire_now(key, 200).tokens_left == pytest.approx(350)
    assert limiter.acquire_now(key, 601).why == "too_large"
    clock.now += 60
    assert limiter.acquire_now(key, 600).tokens_left == 0  # full again, capped at the limit


def test_overrun_is_taken_and_waited_for() -> None:
    clock = Clock()
    limiter, key = LocalLimiter(6.0, clock), api_key(tokens_per_minute=600)
    lease = limiter.acquire_now(key, 100).lease
    limiter.release(key, lease, -300)  # used 400 of 100 reserved: the bucket owes 300
    assert limiter.acquire_now(key, 300).why == "tokens"
    clock.now += 1.0  # +100
    assert limiter.acquire_now(key, 300).why == ""


def test_requests_and_concurrency() -> None:
    clock = Clock()
    limiter = LocalLimiter(60.0, clock)
    key = api_key(requests_per_minute=2, concurrent_requests=1)
    first = limiter.acquire_now(key, 0)
    assert limiter.acquire_now(key, 0).why == "concurrent"
    limiter.release(key, first.lease, 0)
    assert limiter.acquire_now(key, 0).why == ""
    limiter.release(key, None, 0)
    refused = limiter.acquire_now(key, 0)
    assert refused.why == "requests" and refused.retry_after == pytest.approx(30.0)
    assert limiter.in_flight("k") == 0


def test_duration_format() -> None:
    assert [duration(s) for s in (0.0004, 0.02, 1.5, 12.2, 360)] == ["1ms", "20ms", "1.5s",
                                                                        "12s", "6m0s"]


def test_admission_sets_caller_and_settles_once() -> None:
    auth = AuthConfig(window=6, keys=[{"name": "team", "sha256": hash_secret("s"),
                                       "models": ["m"], "weight": 3,
                                       "limits": {"tokens_per_minute": 1000}}])
    # A frozen clock: at 1000 tokens per 6 s the bucket refills a token every 6 ms, which a
    # loaded machine takes between two admissions.
    access = AccessControl(auth, limiter=LocalLimiter(auth.window, Clock()))
    with pytest.raises(InvalidApiKey) as missing:
        access.authenticate(None)
    assert missing.value.status == 401 and missing.value.code == "invalid_api_key"
    with pytest.raises(InvalidApiKey):
        access.authenticate(b"Bearer wrong")
    key = access.authenticate(b"Bearer s")
    with pytest.raises(ModelNotAllowed):
        asyncio.run(access.admit(key, "other", 10, 10))
    grant = asyncio.run(access.admit(key, "m", 100, 400))
    assert key.caller == Caller("team", 3.0)  # the edge's context carries it on
    assert dict(grant.headers)[b"x-ratelimit-remaining-tokens"] == b"500"
    grant.settle(Usage(80, 20))  # 400 back
    grant.settle(Usage(80, 20))  # a second settle changes nothing
    again = asyncio.run(access.admit(key, "m", 100, 800))
    assert dict(again.headers)[b"x-ratelimit-remaining-tokens"] == b"0"
    with pytest.raises(RateLimited) as limited:
        asyncio.run(access.admit(key, "m", 1, 1))
    assert limited.value.status == 429 and "retry-after" in limited.value.headers
    again.settle(None)  # no answer: all of it back
    assert asyncio.run(access.admit(key, "m", 450, 450)).reserved == 900  # 100 used


def test_keys_off_changes_nothing() -> None:
    access = AccessControl(None)
    assert access.authenticate(None) is None
    grant = asyncio.run(access.admit(None, "m", 1, 1))
    assert grant.headers == []


@pytest.mark.parametrize("auth, words", [
    ({"keys": [{"name": "a", "sha256": "xyz"}]}, "auth.keys.0.sha256"),
    ({"keys": [{"name": "a b", "sha256": "0" * 64}]}, "auth.keys.0.name"),
    ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "a", "sha256": "1" * 64}]},
     "unique"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "models": ["nope"]}]}, "unknown models"),
    ({"keys": [{"name": "a", "sha256": "0" * 64, "limits": {"rpm": 1}}]}, "rpm"),
    ({"keys": [], "window": 0}, "auth.window"),
])
def test_config_errors_name_the_key(auth: dict, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, models=[{"name": "m", "replicas": [{"url": "http://x"}]}], auth=auth)
    assert words in str(caught.value)


def test_redis_down_fails_open_or_closed_with_one_log_line_per_transition(
        caplog: pytest.LogCaptureFixture) -> None:
    from redis_support import SHARED_URL, delete_prefix, unique_prefix

    from gateway.access.errors import LimitsUnavailable
    from gateway.access.redis_limits import RedisLimiter
    from gateway.shared.redis_keys import SharedKeys
    from gateway.shared.sync import connect
    from support import free_port

    prefix = unique_prefix()
    key = api_key(tokens_per_minute=1000)

    async def scenario() -> list[str]:
        dead = connect(f"redis://127.0.0.1:{free_port()}/0", 0.5)
        live = connect(SHARED_URL, 0.5)
        limiter = RedisLimiter(dead, SharedKeys(prefix), 60.0, 60.0, "test")
        whys = []
        for _ in range(3):  # down: this instance's own buckets
            limiter._retry_at = 0.0  # try Redis every time, not once per 0.5 s
            outcome = await limiter.acquire(key, 400)
            whys.append(outcome.why)
        limiter.redis, limiter._retry_at = live, 0.0
        for _ in range(2):  # back: the shared bucket (a fresh one: full)
            outcome = await limiter.acquire(key, 400)
            whys.append(outcome.why)
            limiter.release(key, outcome.lease, 400)
        await limiter.close()
        limiter.fail_closed, limiter.redis, limiter._retry_at = True, dead, 0.0
        with pytest.raises(LimitsUnavailable):
            await limiter.acquire(key, 1)
        await dead.aclose()
        await live.aclose()
        return whys

    caplog.set_level(logging.WARNING, logger="gateway.access.redis_limits")
    try:
        whys = asyncio.run(scenario())
    finally:
        delete_prefix(SHARED_URL, prefix)
    assert whys == ["", "", "tokens", "", ""]  # local: 1000 -> 600 -> 200 -> refused
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # down, back, down (fail closed)
    assert "unreachable" in lines[0] and "back" in lines[1] and "fail_closed" in lines[2]


def test_a_keys_objective_and_ceiling_survive_the_shared_store() -> None:
    from gateway.access.store import dump_key, load_key
    from gateway.config import ObjectiveConfig

    key = ApiKey("chat", "ab" * 32, None, 1.0, KeyLimits(), "admin", 5.0,
                 ObjectiveConfig(priority=1, ttft_ms=500), 3)
    again = load_key(dump_key(key))
    assert again is not None and again.objective == key.objective and again.max_priority == 3
    assert again.priority_ceiling == 3
    plain = load_key(dump_key(ApiKey("batch", "cd" * 32, None, 1.0, KeyLimits(), "admin")))
    assert plain is not None and plain.objective is None and plain.priority_ceiling == 0
    assert ApiKey("low", "ef" * 32, None, 1.0, KeyLimits(),
                  objective=ObjectiveConfig(priority=-1)).priority_ceiling == -1
    assert "sha256" not in key.describe() and key.describe()["max_priority"] == 3
