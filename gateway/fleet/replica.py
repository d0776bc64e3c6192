"""One engine process on one GPU, as the gateway sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.engines import Engine, EngineSignals, get as engine_named
from gateway.fleet.role import Role
from gateway.kvcache.index import ReplicaBlocks

__all__ = ["EngineSignals", "Replica", "REPLICA_STATES"]


@dataclass(eq=False)
class Replica:
    """A replica's identity and what is known about it; load lives in the ledger.

    One engine process is one Replica whatever names it serves (model entries that list it,
    aliases, LoRA adapters): one ledger entry, one in-flight count, one outlier record."""

    name: str  # unique key (ledger, metrics label, response header)
    url: str
    engine: str
    model: str  # the model entry it was first listed under: its base, in metrics
    pool: str
    max_model_len: int | None = None  # configured, else discovered from the engine
    max_input_tokens: int | None = None  # TGI's separate prompt limit, when it reports one
    healthy: bool = True  # active health probes pass
    ejected_until: float = 0.0  # wall-clock time (shareable across instances); outlier ejection
    draining: bool = False  # admin: finish in-flight work, take nothing new
    max_concurrent_requests: int | None = None  # the engine's own in-flight limit, if it reports one
    signals: EngineSignals | None = None  # latest scrape of the engine's own load (engine_signals.py)
    version: str | None = None  # the engine's version where it reports one (TGI /info): what it serves
    # Names the engine lists on /v1/models -> their `parent` (a LoRA adapter's base model;
    # None for a base name or an alias). Empty until discovered (gateway/fleet/served_names).
    served_names: dict[str, str | None] = field(default_factory=dict)
    # Its engine's KV-cache events (gateway/kvcache): where they are published, when the
    # config names it, and what they say the engine holds (None: not subscribed).
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_cache: ReplicaBlocks | None = field(default=None, repr=False)
    role: Role = Role.BOTH  # its part in disaggregated serving
    # The last read of any of its streams (perf_counter; the relay's): an engine whose every
    # stream went silent hangs (gateway.migrate), one whose other streams move is just slow.
    streamed_at: float = 0.0
    profile: Engine = field(init=False, repr=False)  # what its engine is and does (engines/)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.profile = engine_named(self.engine)
        self.role = Role(self.role)  # (a name read from DNS, the admin API or a test)
        if self.role is not Role.BOTH and not self.profile.disaggregates:
            raise ValueError(f"replica {self.name!r}: {self.profile.title} cannot hand a "
                             f"prompt's KV cache to another engine (role {self.role.value!r})")

    @property
    def ejected(self) -> bool:
        return self.ejected_until > time.time()

    @property
    def available(self) -> bool:
        """May take new requests: healthy, not ejected, not draining."""
        return self.healthy and not self.draining and not self.ejected

    @property
    def state(self) -> str:
        """One of REPLICA_STATES (the most severe that applies)."""
        if self.draining:
            return "draining"
        if not self.healthy:
            return "unhealthy"
        if self.ejected:
            return "ejected"
        return "healthy"


REPLICA_STATES = ("healthy", "unhealthy", "ejected", "draining")
