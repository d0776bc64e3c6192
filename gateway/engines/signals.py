"""An engine's own load, as its Prometheus ``/metrics`` text reports it: which gauges say so
(``SignalMetrics``, one per engine) and what one scrape found (``EngineSignals``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What one replica reported about itself at ``scraped_at`` (``time.monotonic()``)."""

    running: int | None = None    # sequences in the engine's batch
    waiting: int | None = None    # requests queued inside the engine
    kv_usage: float | None = None  # fraction of the KV cache in use, 0-1
    scraped_at: float = 0.0
    ledger_in_flight: int = 0     # the ledger's in-flight count for the replica at that moment
    # vLLM with LoRA (vllm:lora_requests_info): adapters with requests running and waiting,
    # and how many adapters one batch may hold (--max-loras). None: not reported.
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] | None = None
    max_lora: int | None = None
    kv_blocks: int | None = None  # blocks of KV cache the engine has (vllm:cache_config_info)
    kv_block_size: int | None = None  # tokens per block (the same)

    @property
    def requests(self) -> int | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) + (self.waiting or 0)

    def unexplained_requests(self) -> int:
        """Requests the engine holds beyond what the ledger had placed there at scrape time:
        work from other clients (or other gateways without a shared ledger)."""
        return max(0, (self.requests or 0) - self.ledger_in_flight)

    def fresh(self, now: float, max_age: float) -> bool:
        return now - self.scraped_at <= max_age


class SignalMetrics(NamedTuple):
    """An engine's gauge names: running, waiting, KV used (the first name found counts), and
    the KV total when "used" is not already a 0-1 fraction."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_used: tuple[str, ...] = ()
    kv_total: str | None = None


def samples(text: str, wanted: set[str]) -> dict[str, list[float]]:
    """Values of the wanted sample names (all label sets), from Prometheus text format."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, rest = line[:space], line[space:]
        if name not in wanted:
            continue
        try:  # the value is the first field after the labels (a timestamp may follow)
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            out.setdefault(name, []).append(value)
    return out


def read_signals(metrics: SignalMetrics, text: str, scraped_at: float = 0.0,
                 ledger_in_flight: int = 0) -> EngineSignals:
    """The signals in one engine's /metrics text; gauges it does not expose stay None.

    Several label sets of one gauge (vLLM data-parallel engines, SGLang ranks) add up for
    request counts; KV use takes the fullest one."""
    wanted = {*metrics.running, *metrics.waiting, *metrics.kv_used}
    if metrics.kv_total:
        wanted.add(metrics.kv_total)
    values = samples(text, wanted)

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((values[n] for n in names if n in values), None)

    running, waiting, kv = first(metrics.running), first(metrics.waiting), first(metrics.kv_used)
    kv_usage = max(kv) if kv else None
    if kv_usage is not None and metrics.kv_total is not None:
        total = max(values.get(metrics.kv_total, [0.0]))
        kv_usage = kv_usage / total if total > 0 else None
    return EngineSignals(
        running=int(sum(running)) if running is not None else None,
        waiting=int(sum(waiting)) if waiting is not None else None,
        kv_usage=min(1.0, max(0.0, kv_usage)) if kv_usage is not None else None,
        scraped_at=scraped_at, ledger_in_flight=ledger_in_flight)
