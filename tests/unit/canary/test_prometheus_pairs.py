"""A shadow pool's pairs as the Prometheus-only report counts them: compared, dropped and
skipped copies from the gateways' counters, each series' growth over the window."""

from __future__ import annotations

from gateway.canary.prometheus_report import Prometheus, pair_counts

START, END = 1000.0, 1600.0


class FakePrometheus(Prometheus):
    """Answers queries from fixed series: (name, labels) -> (value at START, at END)."""

    def __init__(self, series: dict[tuple[str, frozenset], tuple[float, float]]) -> None:
        super().__init__("http://prometheus.invalid")
        self.series = series

    def vector(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        name, _, selector = expr.partition("{")
        wanted = dict(part.split("=", 1) for part in selector.rstrip("}").split(","))
        wanted = {k: v.strip('"') for k, v in wanted.items()}
        out = []
        for (series, labels), (before, after) in self.series.items():
            labels = dict(labels)
            if series == name and all(labels.get(k) == v for k, v in wanted.items()):
                out.append((labels, before if at == START else after))
        return out


def _series(name: str, value: tuple[float, float], **labels: str):
    return (name, frozenset({"model": "m", "pool": "shadow", **labels}.items())), value


def test_skipped_copies_are_counted_beside_compared_and_dropped() -> None:
    prom = FakePrometheus(dict([
        _series("llm_gateway_shadow_pairs_total", (10, 40), greedy="true", result="agreed"),
        _series("llm_gateway_shadow_pairs_total", (0, 6), greedy="true", result="disagreed"),
        _series("llm_gateway_shadow_pairs_total", (2, 7), greedy="false", result="agreed"),
        _series("llm_gateway_shadow_pairs_prefix_agreed_total", (10, 44), greedy="true"),
        _series("llm_gateway_shadow_pairs_dropped_total", (1, 4), reason="shadow_failed"),
        _series("llm_gateway_shadow_skipped_total", (0, 50), reason="no_slot"),
        _series("llm_gateway_shadow_skipped_total", (5, 12), reason="in_flight_limit"),
        _series("llm_gateway_shadow_skipped_total", (0, 0), reason="rejected")]))
    counts = pair_counts(prom, "m", "shadow", START, END)
    assert counts == {"greedy_compared": 36, "agreed": 30, "prefix_agreed": 34,
                      "not_greedy": 5, "dropped": 3, "skipped": 57}
