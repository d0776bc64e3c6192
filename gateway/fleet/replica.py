"""One engine process on one GPU, as the gateway sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The engines a replica can run; what each speaks is gateway.protocol.translate's business.
ENGINES = ("vllm", "tgi", "sglang", "llamacpp", "openai")


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

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

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
