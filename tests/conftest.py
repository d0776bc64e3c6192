from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sim.model_dir import write_model_dir
from gateway.tokens import ModelTokenizer

REAL_ENGINES = Path(__file__).parent / "real_engines"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """For make test's ``--dist loadgroup``: each file's tests on one worker (its module
    fixtures start its servers once), and every real-engine file on one worker, one after
    the other: two at once put four vLLM engines on two cores, and their timed checks
    failed (a fresh-clone run: KV-event routing, a drain, a kill)."""
    for item in items:
        path = Path(item.path)
        group = "real-engines" if REAL_ENGINES in path.parents else str(path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory (trained tokenizer.json + chat template), as on a real disk."""
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-chat-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)
