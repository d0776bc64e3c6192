from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sim.model_dir import write_model_dir
from gateway.tokens import ModelTokenizer

REAL_ENGINES_ID = "tests/real_engines/"  # node ids start from the checkout


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """For make test's workers: each file's tests on one worker (its module fixtures start
    its servers once), and every real-engine file on one worker, one after the other: two at
    once put four vLLM engines on two cores, and their timed checks failed (a fresh-clone
    run: KV-event routing, a drain, a kill). Our own grouping, not ``--dist loadgroup``'s
    marks: xdist 3.8 names a mark's group in ``item._nodeid``, which pytest 9.2 no longer
    reads, so every test was its own group (real-engine modules ran on both workers at once,
    and a module's engines were started once per worker)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "real-engines" if path.startswith(REAL_ENGINES_ID) else path

    return ByFile(config, log)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory (trained tokenizer.json + chat template), as on a real disk."""
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-chat-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)
