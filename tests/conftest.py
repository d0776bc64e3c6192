from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sim.model_dir import write_model_dir
from gateway.tokens import ModelTokenizer

# The tiers' order of collection, longest modules first: `make test` hands whole files to
# each worker in this order (--dist loadfile), so the real engines' modules (a minute or
# more each) start at once instead of last, and the short ones fill in around them.
TIER_ORDER = ("real_engines", "e2e", "benchmarks", "integration", "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def tier(item: pytest.Item) -> int:
        parts = Path(item.path).parts
        return next((i for i, name in enumerate(TIER_ORDER) if name in parts), len(TIER_ORDER))
    items.sort(key=tier)  # stable: a file's tests stay together and in order


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory (trained tokenizer.json + chat template), as on a real disk."""
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-chat-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)
