"""One engine process on one GPU, as the gateway sees it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.protocol.errors import Api

if TYPE_CHECKING:
    from gateway.fleet.engine_signals import EngineSignals

# Which client protocols each engine speaks natively. TGI also serves the OpenAI-style
# Messages API (/v1/chat/completions, /v1/completions). The other protocol reaches every engine
# through translation (gateway/protocol/translate).
ENGINE_APIS: dict[str, frozenset[Api]] = {
    "vllm": frozenset({Api.OPENAI}),
    "sglang": frozenset({Api.OPENAI}),
    "llamacpp": frozenset({Api.OPENAI}),
    "openai": frozenset({Api.OPENAI}),
    "tgi": frozenset({Api.OPENAI, Api.TGI}),
}


@dataclass(eq=False)
class Replica:
    """A replica's identity and what is known about it; load lives in the ledger."""

    name: str  # unique key (ledger, metrics label, response header)
    url: str
    engine: str
    model: str
    pool: str
    max_model_len: int | None = None  # configured, else discovered from the engine
    max_input_tokens: int | None = None  # TGI's separate prompt limit, when it reports one
    healthy: bool = True  # active health probes pass
    ejected_until: float = 0.0  # wall-clock time (shareable across instances); outlier ejection
    draining: bool = False  # admin: finish in-flight work, take nothing new
    max_concurrent_requests: int | None = None  # the engine's own in-flight limit, if it reports one
    signals: "EngineSignals | None" = None  # latest scrape of the engine's own load (engine_signals.py)
    version: str | None = None  # the engine's version where it reports one (TGI /info): what it serves
    apis: frozenset[Api] = field(default=frozenset())

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.apis = ENGINE_APIS[self.engine]

    def speaks(self, api: Api) -> bool:
        return api in self.apis

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
