"""Token usage of one generation, as the engine reported it (None: not reported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None  # why generation stopped, as the client was told
    stored_id: str | None = None  # the id the engine stored the answer under (a Response)
