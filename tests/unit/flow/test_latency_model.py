"""The online latency model (gateway/flow/latency_model.py): nothing until it has seen
enough, then it recovers a linear truth from noisy samples and follows a change."""

from __future__ import annotations

import random

from gateway.balance.ledger import ReplicaLoad
from gateway.flow.latency_model import LatencyModel


def truth(load: ReplicaLoad, prompt: int, slow: float = 1.0) -> tuple[float, float]:
    ttft = slow * (0.02 + 0.1 * (load.prefill_tokens + prompt) / 1000 + 0.004 * (load.in_flight + 1))
    tpot = slow * (0.01 + 0.001 * (load.in_flight + 1))
    return ttft, tpot


def train(model: LatencyModel, n: int, rng: random.Random, slow: float = 1.0) -> None:
    for _ in range(n):
        load = ReplicaLoad(0, rng.randrange(0, 64), rng.randrange(0, 8000))
        prompt = rng.randrange(10, 4000)
        ttft, tpot = truth(load, prompt, slow)
        x = model.predict(load, prompt).features
        model.observe(x, ttft * rng.uniform(0.95, 1.05), tpot * rng.uniform(0.95, 1.05))


def errors(model: LatencyModel, rng: random.Random, slow: float = 1.0) -> list[float]:
    out = []
    for _ in range(200):
        load, prompt = ReplicaLoad(0, rng.randrange(0, 64), rng.randrange(0, 8000)), 1000
        predicted = model.predict(load, prompt)
        out.append(abs(predicted.ttft - truth(load, prompt, slow)[0]) / truth(load, prompt, slow)[0])
    return sorted(out)


def test_no_prediction_before_enough_samples_then_a_close_one() -> None:
    model, rng = LatencyModel(min_samples=20), random.Random(1)
    assert model.predict(ReplicaLoad(), 100).ttft is None
    train(model, 19, rng)
    assert model.predict(ReplicaLoad(), 100).ttft is None
    train(model, 300, rng)
    assert errors(model, rng)[180] < 0.05  # p90 relative error within the 5% noise


def test_it_follows_an_engine_that_slows_down() -> None:
    model, rng = LatencyModel(), random.Random(2)
    train(model, 300, rng)
    train(model, 1500, rng, slow=2.0)
    assert errors(model, rng, slow=2.0)[180] < 0.1


def test_a_steady_load_for_a_long_time_does_not_wind_the_model_up() -> None:
    """The same features again and again (a steady load) inflate plain RLS with forgetting
    until it overflows; the model stays finite and still learns a change afterwards."""
    model, rng = LatencyModel(), random.Random(3)
    x = model.predict(ReplicaLoad(0, 2, 100), 100).features
    for _ in range(200_000):
        model.observe(x, 0.05, 0.01)
    assert abs(model.predict(ReplicaLoad(0, 2, 100), 100).ttft - 0.05) < 1e-3
    train(model, 2000, rng)
    assert errors(model, rng)[180] < 0.05
