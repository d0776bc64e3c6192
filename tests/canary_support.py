"""Pools for canary tests: one replica each, named after its pool."""

from __future__ import annotations


def weighted_pools(*pools: tuple[str, float, str]) -> list[dict]:
    """(name, weight, replica URL) -> the config's pool entries."""
    return [{"name": name, "weight": weight, "replicas": [{"url": url, "name": name}]}
            for name, weight, url in pools]
