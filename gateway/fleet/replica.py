"""One engine process on one GPU, as the gateway sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.protocol.errors import Api

# Which client protocols each engine speaks natively. TGI also serves the OpenAI-style
# Messages API (/v1/chat/completions, /v1/completions).
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
    healthy: bool = True
    apis: frozenset[Api] = field(default=frozenset())

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.apis = ENGINE_APIS[self.engine]

    def speaks(self, api: Api) -> bool:
        return api in self.apis
