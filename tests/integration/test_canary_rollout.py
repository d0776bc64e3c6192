"""The rollout driver against a real gateway, real simulated replicas and a real Redis, run as
users run it (``python -m gateway canary rollout``) while traffic flows: a healthy canary goes
from 5 to 100, a 30% slower one is rolled back at its first step, a killed driver is resumed
by the next one, a second driver refuses to run beside the first, and a canary the guard rolls
back is never raised again."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import redis

from gateway.canary.rollout import parse_steps
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.shared.redis_keys import SharedKeys
from redis_support import SHARED_URL, shared_prefix
from support import ROOT, gateway_server, sim, wait_until

MODEL = "sim-model"
TOKEN = "rollout-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# Delays of tens of ms, so jitter on a loaded machine stays small beside them (as in
# tests/test_canary_verdict.py).
PACED = ("--profile", "paced", "--ttft-ms", "50", "--itl-ms", "25")
FAST = ("--hold", "3s", "--check-every", "0.5s", "--max-hold", "90s", "--lock-ttl", "3s")


@contextlib.contextmanager
def fleet(tmp: Path, canary: tuple[str, ...], prefix: str,
          **canary_settings: object) -> Iterator[str]:
    with sim("vllm", MODEL, 4096, *PACED) as a, sim("vllm", MODEL, 4096, *canary) as b:
        config = {"models": [{"name": MODEL, "pools": [
            {"name": "stable", "weight": 100, "replicas": [{"url": a, "name": "stable-1"}]},
            {"name": "canary", "weight": 0, "replicas": [{"url": b, "name": "canary-1"}]}]}],
            "health": {"interval": 0.5}, "admin_token": TOKEN, "redis_url": SHARED_URL,
            "redis_key_prefix": prefix,
            "canary": {"samples_sync_interval": 0.2, "judge": {"min_samples": 12},
                       **canary_settings}}
        with gateway_server(tmp, config) as (url, _), traffic(url):
            yield url


@contextlib.contextmanager
def traffic(url: str, users: int = 12) -> Iterator[None]:
    """Streamed requests without a session key (each drawn by weight), until the block ends."""
    stop = threading.Event()

    def user() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                body = {"model": MODEL, "prompt": "roll", "max_tokens": 4, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as response:
                    response.read()

    threads = [threading.Thread(target=user, daemon=True) for _ in range(users)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def driver(url: str, prefix: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway", "canary", "rollout", "--model",
                             MODEL, "--canary", "canary", "--gateway", url, "--admin-token",
                             TOKEN, "--redis-url", SHARED_URL, "--redis-key-prefix", prefix,
                             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def weights(url: str) -> dict[str, float]:
    (model,) = httpx.get(f"{url}/admin/models", headers=AUTH).json()["models"]
    return {p["pool"]: p["weight"] for p in model["pools"]}


def state(prefix: str) -> dict[str, str]:
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        return client.hgetall(SharedKeys(prefix).canary_rollout(MODEL))
    finally:
        client.close()


def lock_holder(prefix: str) -> str | None:
    client = redis.Redis.from_url(SHARED_URL, decode_responses=True)
    try:
        return client.get(SharedKeys(prefix).canary_rollout_lock(MODEL))
    finally:
        client.close()


def test_steps_must_rise_within_0_and_100() -> None:
    assert parse_steps("5,25,50,100") == [5, 25, 50, 100]
    for bad in ("50,25", "0,50", "5,150", "5,5", "a,b", ""):
        with pytest.raises(Exception):
            parse_steps(bad)


def test_without_redis_the_driver_refuses_with_a_clear_message() -> None:
    done = subprocess.run([sys.executable, "-m", "gateway", "canary", "rollout", "--model", MODEL,
                           "--canary", "canary", "--redis-url", ""], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 4 and "--redis-url" in done.stderr


def test_a_healthy_canary_goes_from_5_to_100_and_a_second_driver_refuses(tmp_path) -> None:
    with shared_prefix() as prefix, fleet(tmp_path, PACED, prefix) as url:
        first = driver(url, prefix, "--steps", "5,25,50,100", *FAST)
        wait_until(lambda: lock_holder(prefix) is not None, 20, "the first driver's lock")
        code, out = finish(driver(url, prefix, "--steps", "5,25,50,100", *FAST), 60)
        assert code == 5 and "another driver runs this rollout" in out, out
        code, out = finish(first)
        assert code == 0, out
        for step in ("1/4: canary `canary` at 5%", "2/4: canary `canary` at 25%",
                     "3/4: canary `canary` at 50%", "4/4: canary `canary` at 100%"):
            assert step in out, out
        assert weights(url) == {"stable": 0.0, "canary": 100.0}
        assert state(prefix)["state"] == "done"


def test_a_30_percent_slower_canary_is_rolled_back_at_its_first_step(tmp_path) -> None:
    with shared_prefix() as prefix, \
            fleet(tmp_path, (*PACED, "--slowdown", "1.3"), prefix) as url:
        code, out = finish(driver(url, prefix, "--steps", "5,25,50,100", *FAST))
        assert code == 1 and "rolled back at 5%" in out and "ttft" in out, out
        assert "25%" not in out
        assert weights(url) == {"stable": 100.0, "canary": 0.0}
        assert state(prefix)["state"] == "rolled_back"


def test_a_killed_driver_is_resumed_where_it_was(tmp_path) -> None:
    with shared_prefix() as prefix, fleet(tmp_path, PACED, prefix) as url:
        first = driver(url, prefix, "--steps", "5,25,50,100", *FAST)
        def at_25_percent() -> bool:
            assert first.poll() is None, state(prefix)
            return state(prefix).get("step") == "1"

        wait_until(at_25_percent, 120, lambda: state(prefix), every=0.1)
        started = float(state(prefix)["step_started"])
        first.send_signal(signal.SIGKILL)
        first.communicate()
        resumed_at = time.time()
        code, out = finish(driver(url, prefix, "--steps", "5,25,50,100", *FAST))
        assert code == 0, out
        assert "resuming step 2/4 (25%)" in out and "1/4" not in out, out
        assert "step 2/4 (25%): pass" in out and weights(url)["canary"] == 100.0
        # Resumed, not restarted: the step kept its start, so its hold went on.
        assert "2/4: canary `canary` at 25%" not in out
        held = float(re.search(r"step 2/4 \(25%\): \S+ after (\d+)s", out)[1])
        assert held >= resumed_at - started - 1, (held, resumed_at - started)


def test_a_canary_the_guard_rolls_back_is_never_raised_again(tmp_path) -> None:
    with shared_prefix() as prefix, \
            fleet(tmp_path, (*PACED, "--slowdown", "1.3"), prefix, auto_rollback=True,
                  check_every=0.3) as url:
        # The driver checks rarely: the guard gets there first.
        code, out = finish(driver(url, prefix, "--steps", "25,100", "--hold", "30s",
                                  "--check-every", "8s", "--lock-ttl", "3s"))
        assert code == 1 and "set to 0 outside the driver" in out, out
        assert weights(url)["canary"] == 0.0
        verdict = httpx.get(f"{url}/admin/canary/{MODEL}", headers=AUTH).json()
        assert verdict["rollbacks"] and verdict["rollbacks"][0]["pool"] == "canary"
        assert state(prefix)["state"] == "rolled_back"


def _model(stable: float, canary: float) -> ServedModel:
    pools = [Pool(name, weight, [Replica(f"{name}-1", "http://x", "vllm", MODEL, name)])
             for name, weight in (("stable", stable), ("canary", canary))]
    return ServedModel(MODEL, pools, None, 4096, 16)


def test_run_time_weights_do_not_swap_the_default_baseline() -> None:
    from gateway.canary.verdict_plan import choose_pools

    model = _model(95, 5)
    for pool, weight in (("stable", 25), ("canary", 75)):  # the rollout at 75%
        next(p for p in model.pools if p.name == pool).weight = weight
    assert choose_pools(model, None, None) == ("stable", "canary")


def test_the_guard_never_zeroes_a_promoted_canary_that_serves_alone() -> None:
    from gateway.canary.guard import CanaryGuard
    from gateway.canary.samples import SampleBook
    from gateway.canary.sample_source import SampleSource
    from gateway.canary.weights import PoolWeights
    from gateway.canary.config import CanaryJudgeConfig
    from gateway.canary.metrics import CanaryMetrics

    failing = {"verdict": "fail", "score": 0.0, "metrics": [
        {"metric": "ttft", "class": "fail", "critical": True}]}
    for stable, rolled_back in ((25, True), (0, False)):
        model = _model(100, 0)
        weights = PoolWeights({MODEL: model})
        weights.set_weight(MODEL, "stable", stable)
        weights.set_weight(MODEL, "canary", 100 - stable)
        guard = CanaryGuard({MODEL: model}, SampleSource(SampleBook()), weights,
                            CanaryMetrics(None), CanaryJudgeConfig(), 60, auto_rollback=True)
        guard.apply([(MODEL, "stable", "canary", failing)])
        assert (weights.pool(MODEL, "canary").weight == 0) == rolled_back
