"""The real-engine tier: real vLLM (CPU build) and llama.cpp servers serving a tiny
random-weight Llama that the tests write, with the gateway in front.

Part of `make test` and so of CI. ``GATEWAY_SKIP_REAL_ENGINES=1`` skips the tier for a quick
local run (the set-up then installs no engine); CI's `.ci/run` unsets it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines import SKIP_ENV, gguf_of
from tiny_model import write_tiny_llama


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SKIP_ENV) != "1":
        return
    skip = pytest.mark.skip(reason=f"{SKIP_ENV}=1: the real-engine tier is skipped")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a Hugging Face model directory (weights, tokenizer, chat template)."""
    return write_tiny_llama(tmp_path_factory.mktemp("real-model") / "tiny")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model as GGUF, for llama.cpp."""
    return gguf_of(tiny_model, tmp_path_factory.mktemp("real-gguf") / "tiny.gguf")
