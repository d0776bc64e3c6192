"""Served models and their pools of replicas, built from the settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gateway.config import ModelConfig, ObjectiveConfig, Settings
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
    aliases: tuple[str, ...] = ()  # more configured names, served by every replica
    discover_names: bool = True  # also the names its replicas list on /v1/models
    load_adapters: dict[str, str] = field(default_factory=dict)  # adapter -> path, loaded on demand
    objective: ObjectiveConfig | None = None  # its requests' default priority and objectives

    @property
    def replicas(self) -> list[Replica]:
        return [r for pool in self.pools for r in pool.replicas]

    def __post_init__(self) -> None:
        # The configured names: the entry's own and its aliases (read on every request).
        self.names: tuple[str, ...] = (self.name, *self.aliases)

    def replicas_for(self, name: str) -> list[Replica]:
        """The replicas that serve ``name``: all of them for a configured name, else those
        whose engine lists it (an adapter loaded on some replicas only)."""
        if name in self.names:
            return self.replicas
        if not self.discover_names and name not in self.load_adapters:
            return []
        return [r for r in self.replicas if name in r.served_names]

    def window(self, replica: Replica) -> int | None:
        """The context window that applies to ``replica`` (None while unknown)."""
        return self.max_model_len or replica.max_model_len


def build_model(config: ModelConfig, known: dict[str, Replica] | None = None) -> ServedModel:
    """``known``: replicas already built for other entries, by name; an engine listed again
    (another of its names) is the same Replica, so its load is counted once."""
    known = {} if known is None else known
    pools = []
    seen: set[str] = set()
    for pool_config in config.pools or []:
        replicas = []
        for replica_config in (r for rc in pool_config.replicas for r in rc.expand()):
            url = replica_config.url or ""
            name = replica_config.name or url.split("://", 1)[-1].rstrip("/")
            if name in seen:
                raise ValueError(f"replica {name!r} is listed twice in model {config.name!r}")
            seen.add(name)
            replica = known.get(name)
            if replica is None:
                replica = known[name] = Replica(name=name, url=url, engine=replica_config.engine,
                                                model=config.name, pool=pool_config.name,
                                                max_model_len=replica_config.max_model_len,
                                                kv_events=replica_config.kv_events,
                                                kv_replay=replica_config.kv_replay,
                                                role=replica_config.role)
            elif ((replica.url, replica.engine, replica.pool, replica.role)
                  != (url.rstrip("/"), replica_config.engine, pool_config.name,
                      replica_config.role)):
                # One engine, one pool: the canary split and its metrics name the pool.
                raise ValueError(f"replica {name!r} is listed twice with a different url, "
                                 f"engine, pool or role (models {replica.model!r} and "
                                 f"{config.name!r})")
            replicas.append(replica)
        # A shadow pool takes no primary traffic: its weight is 0, whatever the config says.
        weight = 0.0 if pool_config.shadow_of else pool_config.weight
        pools.append(Pool(pool_config.name, weight, replicas, pool_config.shadow_of,
                          pool_config.sample))
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    if tokenizer is not None:
        tokenizer.enable_cache(int(config.token_cache_mb * 1024 * 1024))
    return ServedModel(config.name, pools, tokenizer, config.max_model_len,
                       config.default_output_tokens, config.output_past_window == "cap",
                       tuple(config.aliases), config.discover_names, dict(config.load_adapters),
                       config.objective.set_or_none())


def build_models(settings: Settings) -> dict[str, ServedModel]:
    """One entry per configured model; a replica listed under several is one Replica."""
    known: dict[str, Replica] = {}
    return {m.name: build_model(m, known) for m in settings.models}
