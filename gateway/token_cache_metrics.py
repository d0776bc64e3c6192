"""The prefix token cache for Prometheus (``gateway.token_cache``), read before each scrape:

- ``llm_gateway_token_cache_tokens_total{model, result=hit|miss}``: prompt tokens whose ids
  came from the cache, and those tokenized (then kept);
- ``llm_gateway_token_cache_bytes{model}``: what the cache holds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.fleet.model import ServedModel


class TokenCacheMetrics:
    def __init__(self, registry: CollectorRegistry | None,
                 models: dict[str, ServedModel]) -> None:
        r = registry or CollectorRegistry()  # metrics off: counted nowhere visible
        self.models = models
        self.tokens = Counter("llm_gateway_token_cache_tokens", "Prompt tokens whose ids came "
                              "from the prefix token cache (hit) or were tokenized (miss).",
                              ("model", "result"), registry=r)
        self.size = Gauge("llm_gateway_token_cache_bytes", "Bytes the prefix token cache "
                          "holds (segments' text and ids).", ("model",),
                          multiprocess_mode="livesum", registry=r)
        self._counted: dict[str, tuple[int, int]] = {}  # per model: hits, misses counted
        for name, model in models.items():
            if model.tokenizer is not None and model.tokenizer.cache is not None:
                for result in ("hit", "miss"):
                    self.tokens.labels(name, result)

    def read(self) -> None:
        # A tokenizer shared by several models: its counts under the first model only.
        seen: set[int] = set()
        for name, model in self.models.items():
            cache = model.tokenizer.cache if model.tokenizer is not None else None
            if cache is None or id(cache) in seen:
                continue
            seen.add(id(cache))
            hits, misses = cache.hit_tokens, cache.miss_tokens
            was_hits, was_misses = self._counted.get(name, (0, 0))
            self.tokens.labels(name, "hit").inc(hits - was_hits)
            self.tokens.labels(name, "miss").inc(misses - was_misses)
            self._counted[name] = (hits, misses)
            self.size.labels(name).set(cache.bytes)
