from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sim.model_dir import write_model_dir
from gateway.tokens import ModelTokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory (trained tokenizer.json + chat template), as on a real disk."""
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-chat-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)
