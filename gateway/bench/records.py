"""What the load generator sends and what it records: one ``Request``, and one ``Record`` per
request sent (``gateway.bench.loadgen`` has the whole picture)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Api = Literal["openai", "tgi"]

# Error kinds (Record.error): "http_<status>", or one of these. An incomplete stream ended
# cleanly at the HTTP level but without its last event (OpenAI `data: [DONE]`, TGI's event
# with `generated_text`), which strict clients wait for.
CONNECT, TIMEOUT, DISCONNECTED, STREAM_ERROR, BAD_RESPONSE, INCOMPLETE_STREAM = (
    "connect", "timeout", "disconnected", "stream_error", "bad_response", "incomplete_stream")

DEFAULT_ENDPOINTS = {("openai", False): "/v1/completions", ("openai", True): "/v1/completions",
                     ("tgi", False): "/generate", ("tgi", True): "/generate_stream"}


@dataclass(slots=True)
class Request:
    """One request to send. ``prompt`` for completions and TGI; chat sends ``messages``, or
    ``prompt`` as one user message. ``tag`` is carried to the record (e.g. "long"/"short")."""

    prompt: str = ""
    max_tokens: int = 16
    messages: list[dict[str, Any]] | None = None
    tag: str = ""

    def text(self) -> str:
        """The prompt as one string (messages' contents joined) for completions and TGI."""
        return self.prompt or "\n".join(str(m.get("content", "")) for m in self.messages or [])


@dataclass(slots=True)
class Record:
    """What one request did. Times are perf_counter seconds (``Run.started`` is the zero)."""

    index: int                      # position in the request list / arrival schedule
    due: float                      # when it was meant to start (open loop: its arrival)
    sent: float = 0.0               # when it was written to a connection
    end: float = 0.0
    first_token: float | None = None  # streams: first token event; else the whole response
    status: int = 0
    error: str | None = None        # None = success; else an error kind
    detail: str = ""                # error message (truncated)
    prompt_tokens: int | None = None
    output_tokens: int = 0          # usage when present, else counted token events
    events: int = 0                 # token events seen (streams)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, token events)
    replica: str | None = None      # x-gateway-replica
    pool: str | None = None         # x-gateway-pool
    user: int | None = None         # closed loop: which user sent it
    tag: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.due

    @property
    def e2e(self) -> float:
        return self.end - self.due
