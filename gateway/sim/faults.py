"""Injected faults, settable by CLI flags at start and by ``POST /sim/faults`` at run time.

The JSON names equal the flag names with ``_`` for ``-``: ``fail_health``, ``error_rate``,
``error_status``, ``stall_after``, ``drop_after``, ``slowdown``. ``null`` clears a token fault.
Two more, run time only, for a replica that publishes KV events (``kv_publisher.py``):
``kv_garbage`` (malformed messages to send) and ``kv_skip`` (batches to leave out of the
live stream); each counts down as it is done.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class FaultError(ValueError):
    """A ``POST /sim/faults`` body that names an unknown fault or a bad value."""


@dataclass
class Faults:
    fail_health: bool = False          # /health answers 503 in the dialect's shape
    error_rate: float = 0.0            # share of generation requests answered with error_status
    error_status: int = 500            # 500 or 503
    stall_after: int | None = None     # stop emitting after N tokens, keep the connection open
    drop_after: int | None = None      # close the connection abruptly after N tokens
    slowdown: float = 1.0              # every simulated delay is multiplied by this
    kv_garbage: int = 0                # KV events: malformed messages still to send
    kv_skip: int = 0                   # KV events: batches still to leave out of the live stream
    rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False, compare=False)

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self.rng.random() < self.error_rate

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("rng")
        return out

    def update(self, changes: Any) -> None:
        """Apply a JSON object of changes; all-or-nothing."""
        if not isinstance(changes, dict):
            raise FaultError("body must be a JSON object of fault names to values")
        known = {f.name for f in fields(self)} - {"rng"}
        staged = self.as_dict()
        for name, value in changes.items():
            if name not in known:
                raise FaultError(f"unknown fault {name!r}; known: {', '.join(sorted(known))}")
            staged[name] = value
        check(staged)
        for name, value in staged.items():
            setattr(self, name, value)


def check(values: dict[str, Any]) -> None:
    def number(name: str, lo: float, hi: float | None = None) -> None:
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo or (hi is not None and v > hi):
            raise FaultError(f"{name} must be a number in [{lo}, {hi if hi is not None else 'inf'}]")

    if not isinstance(values["fail_health"], bool):
        raise FaultError("fail_health must be true or false")
    number("error_rate", 0.0, 1.0)
    if values["error_status"] not in (500, 503):
        raise FaultError("error_status must be 500 or 503")
    for name in ("kv_garbage", "kv_skip"):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FaultError(f"{name} must be a non-negative integer")
    for name in ("stall_after", "drop_after"):
        v = values[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise FaultError(f"{name} must be null or a non-negative integer")
    number("slowdown", 0.0)
    if values["slowdown"] <= 0:
        raise FaultError("slowdown must be > 0")
