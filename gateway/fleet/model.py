"""Served models and their pools of replicas, built from the settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.config import ModelConfig, Settings
from gateway.fleet.replica import Replica
from gateway.tokens import ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pool:
    """A weighted group of replicas of one model (e.g. ``stable`` and ``canary``)."""

    name: str
    weight: float
    replicas: list[Replica]
    shadow_of: str | None = None  # canary: gets copies of this pool's requests, no traffic
    sample: float = 0.0  # with shadow_of: the share of requests copied
    # The weight the config gave it (``weight`` changes at run time, e.g. during a rollout):
    # the canary verdict's default baseline is the pool configured heaviest.
    configured_weight: float | None = None

    def __post_init__(self) -> None:
        if self.configured_weight is None:
            self.configured_weight = self.weight


@dataclass(eq=False)
class ServedModel:
    name: str
    pools: list[Pool]
    tokenizer: ModelTokenizer | None
    max_model_len: int | None  # from config; overrides what replicas report
    default_output_tokens: int
    cap_output: bool = False  # output_past_window: cap (else reject)

    @property
    def replicas(self) -> list[Replica]:
        return [r for pool in self.pools for r in pool.replicas]

    def window(self, replica: Replica) -> int | None:
        """The context window that applies to ``replica`` (None while unknown)."""
        return self.max_model_len or replica.max_model_len


def build_model(config: ModelConfig) -> ServedModel:
    pools = []
    for pool_config in config.pools or []:
        replicas = []
        for replica_config in (r for rc in pool_config.replicas for r in rc.expand()):
            url = replica_config.url or ""
            name = replica_config.name or url.split("://", 1)[-1].rstrip("/")
            replicas.append(Replica(name=name, url=url, engine=replica_config.engine,
                                    model=config.name, pool=pool_config.name,
                                    max_model_len=replica_config.max_model_len))
        # A shadow pool takes no primary traffic: its weight is 0, whatever the config says.
        weight = 0.0 if pool_config.shadow_of else pool_config.weight
        pools.append(Pool(pool_config.name, weight, replicas, pool_config.shadow_of,
                          pool_config.sample))
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    return ServedModel(config.name, pools, tokenizer, config.max_model_len,
                       config.default_output_tokens, config.output_past_window == "cap")


def build_models(settings: Settings) -> dict[str, ServedModel]:
    models = {m.name: build_model(m) for m in settings.models}
    seen: dict[str, str] = {}
    for model in models.values():
        for replica in model.replicas:
            if replica.name in seen:
                raise ValueError(f"replica {replica.name!r} is listed twice "
                                 f"(models {seen[replica.name]!r} and {model.name!r})")
            seen[replica.name] = model.name
    return models
