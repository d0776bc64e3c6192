"""The engines a replica can run, by config name: one module each, behind one ``Engine``
interface (``base.py``). Adding an engine is one module and one line here."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from gateway.engines import llamacpp, lmdeploy, openai, sglang, tgi, vllm
from gateway.engines.base import Engine, EngineInfo
from gateway.engines.signals import EngineSignals

__all__ = ["ENGINES", "NAMES", "Engine", "EngineInfo", "EngineSignals", "get"]

ENGINES: Mapping[str, Engine] = MappingProxyType({e.name: e for e in (
    vllm.ENGINE,
    tgi.ENGINE,
    sglang.ENGINE,
    llamacpp.ENGINE,
    openai.ENGINE,
    lmdeploy.ENGINE,
)})
NAMES = tuple(ENGINES)


def get(name: str) -> Engine:
    """The engine of a config name (KeyError for an unknown one; config validation names
    only known ones)."""
    return ENGINES[name]
