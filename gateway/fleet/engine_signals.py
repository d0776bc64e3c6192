"""Engine load signals: each replica's own queue depth and KV-cache use, scraped from /metrics.

The ledger knows exactly what this gateway sent; the engine knows what it is actually
running, including work other clients sent straight to it. A ``Scraper`` reads each replica's
Prometheus endpoint every ``interval`` seconds and stores the latest ``EngineSignals`` on the
replica; policies blend them in only while they are fresh (see
``gateway/balance/least_expected_work.py``). A failed or slow scrape changes nothing: the old
signals simply grow stale and stop counting.

Metric names per engine (``reference/ENGINE-WIRE.md``), as (running, waiting, KV use 0-1):

- vllm: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.9);
- sglang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``;
- tgi: ``tgi_batch_current_size``, ``tgi_queue_size``,
  ``tgi_batch_current_max_tokens / tgi_batch_max_total_tokens``;
- llamacpp: ``llamacpp:requests_processing``, ``llamacpp:requests_deferred`` (no KV gauge).

vLLM with LoRA also reports ``vllm:lora_requests_info{max_lora, running_lora_adapters,
waiting_lora_adapters}`` (comma-joined adapter names; the value is when it was set, and
older label sets linger: the newest counts), read for adapter-aware placement.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import Callable, Sequence

import aiohttp

from gateway.fleet.replica import EngineSignals, Replica

__all__ = ["EngineSignals", "SignalScraper", "parse_signals"]

log = logging.getLogger("gateway.signals")


# engine -> (running, waiting, kv used, kv total or None when "kv used" is already a fraction)
_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str | None]] = {
    "vllm": (("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), None),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",),
               ("sglang:token_usage",), None),
    "tgi": (("tgi_batch_current_size",), ("tgi_queue_size",),
            ("tgi_batch_current_max_tokens",), "tgi_batch_max_total_tokens"),
    "llamacpp": (("llamacpp:requests_processing",), ("llamacpp:requests_deferred",), (), None),
}

SCRAPED_ENGINES = frozenset(_NAMES)


def _samples(text: str, wanted: set[str]) -> dict[str, list[float]]:
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


LORA_INFO = "vllm:lora_requests_info"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _names(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def parse_lora_info(text: str) -> tuple[frozenset[str], frozenset[str], int | None] | None:
    """(running adapters, waiting adapters, max_lora) of the newest ``vllm:lora_requests_info``
    sample, or None when there is none."""
    newest: tuple[float, dict[str, str]] | None = None
    at = text.find(LORA_INFO + "{")
    while at != -1:
        end = text.find("\n", at)
        line = text[at:end if end != -1 else len(text)]
        close = line.rfind("}")
        try:
            value = float(line[close + 1:].split()[0])
        except (ValueError, IndexError):
            value = math.nan
        if close != -1 and math.isfinite(value) and (newest is None or value >= newest[0]):
            newest = value, dict(_LABEL.findall(line[len(LORA_INFO) + 1:close]))
        at = text.find(LORA_INFO + "{", at + 1)
    if newest is None:
        return None
    labels = newest[1]
    max_lora = labels.get("max_lora", "")
    return (_names(labels.get("running_lora_adapters", "")),
            _names(labels.get("waiting_lora_adapters", "")),
            int(max_lora) if max_lora.isdigit() else None)


def parse_signals(engine: str, text: str, scraped_at: float = 0.0,
                  ledger_in_flight: int = 0) -> EngineSignals:
    """The signals in one engine's /metrics text; fields it does not expose stay None.

    Several label sets of one gauge (vLLM data-parallel engines, SGLang ranks) add up for
    request counts; KV use takes the fullest one."""
    running_names, waiting_names, kv_names, kv_total_name = _NAMES[engine]
    wanted = {*running_names, *waiting_names, *kv_names}
    if kv_total_name:
        wanted.add(kv_total_name)
    values = _samples(text, wanted)

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((values[n] for n in names if n in values), None)

    running, waiting, kv = first(running_names), first(waiting_names), first(kv_names)
    kv_usage = max(kv) if kv else None
    if kv_usage is not None and kv_total_name is not None:
        total = max(values.get(kv_total_name, [0.0]))
        kv_usage = kv_usage / total if total > 0 else None
    lora = parse_lora_info(text) if engine == "vllm" and LORA_INFO in text else None
    return EngineSignals(
        lora_running=lora[0] if lora else None, lora_waiting=lora[1] if lora else None,
        max_lora=lora[2] if lora else None,
        running=int(sum(running)) if running is not None else None,
        waiting=int(sum(waiting)) if waiting is not None else None,
        kv_usage=min(1.0, max(0.0, kv_usage)) if kv_usage is not None else None,
        scraped_at=scraped_at, ledger_in_flight=ledger_in_flight)


class SignalScraper:
    """Scrapes every replica of a scrapable engine, every ``interval`` seconds, forever."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], session: aiohttp.ClientSession,
                 in_flight: Callable[[str], int], interval: float, timeout: float) -> None:
        self.replicas = replicas
        self.session = session
        self.in_flight = in_flight  # replica name -> requests the ledger has placed there
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def scrape(self, replica: Replica) -> None:
        """One scrape; on any failure the replica keeps its old (aging) signals."""
        try:
            async with self.session.get(f"{replica.url}/metrics", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        # The ledger's count is read when the answer arrives, the moment the engine's is nearest.
        replica.signals = parse_signals(replica.engine, text, time.monotonic(),
                                        self.in_flight(replica.name))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(r) for r in self.replicas()
                               if r.engine in SCRAPED_ENGINES))

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_all()
            except Exception:  # never let one bad scrape end the loop
                log.exception("engine signal scrape failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
