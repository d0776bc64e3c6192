"""A replica's part in disaggregated serving (``gateway/dataplane/prefill.py``)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    BOTH = "both"        # prefills and answers: an ordinary engine
    PREFILL = "prefill"  # only prefills prompts, for a decode engine to pull their KV cache
    DECODE = "decode"    # answers from the KV cache a prefill engine made

    @property
    def answers(self) -> bool:
        """Whether a client's answer can be placed on it (a prefill engine's cannot)."""
        return self is not Role.PREFILL
