"""Simulated replicas shared by the tests of one module (startup costs about a second)."""

from __future__ import annotations

from typing import Any, Callable

import httpx
import pytest

from tests.support import sim

# Fast clock and small outputs keep the whole sim suite well under a minute and a half.
FAST = ["--profile", "llama3-8b-a100", "--speed", "50", "--mean-output-tokens", "12"]


@pytest.fixture(scope="module")
def replica(request: pytest.FixtureRequest) -> Callable[..., str]:
    """``replica(dialect, *flags)`` -> base URL; one process per distinct argument list."""
    stack: dict[tuple, Any] = {}

    def start(dialect: str, *flags: str, max_model_len: int = 4096) -> str:
        key = (dialect, max_model_len, flags)
        if key not in stack:
            cm = sim(dialect, "sim-model", max_model_len, *flags)
            stack[key] = (cm, cm.__enter__())
        return stack[key][1]

    yield start
    for cm, _ in stack.values():
        cm.__exit__(None, None, None)


def state(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/sim/state").json()

