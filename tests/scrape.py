"""Reading a server's /metrics in the tests: the gateway's, or an engine's (real or simulated).
One parser for all (prometheus_client's), so label quoting, escapes and ``_total`` suffixes
are read the same everywhere."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]


def samples(url: str, timeout: float = 10.0) -> list[Sample]:
    """Every sample of ``url``'s /metrics as (name, labels, value)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout).text
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(value for n, l, value in samples(url)
               if n == name and all(l.get(k) == v for k, v in labels.items()))


def by_label(url: str, name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label`` (among those matching ``labels``)."""
    out: dict[str, float] = {}
    for n, l, value in samples(url):
        if n == name and label in l and all(l.get(k) == v for k, v in labels.items()):
            out[l[label]] = out.get(l[label], 0.0) + value
    return out


def has_series(url: str, name: str) -> bool:
    return any(n == name for n, _, _ in samples(url))
