"""Injected faults, settable by CLI flags at start and by ``POST /sim/faults`` at run time.

The JSON names equal the flag names with ``_`` for ``-``: ``fail_health``, ``error_rate``,
``error_status``, ``stall_after``, ``drop_after``, ``error_after``, ``break_rate``,
``break_at_end``, ``slowdown``. ``null`` clears a token fault. ``break_rate`` breaks that share of streams at a
point drawn at random (after token 1 .. n, the last one meaning after every token but
before the stream's end), each way at random: dropped, stalled or ended by an error event;
``break_at_end`` (``"drop"``, ``"stall"`` or ``"error"``) breaks every stream that way after
its last token, before the events that end it.
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


BREAK_KINDS = ("drop", "stall", "error")


@dataclass(frozen=True)
class Break:
    """Where one stream breaks and how: ``drop`` (the connection closed), ``stall`` (no more
    events, the connection kept open), ``error`` (the engine's error event). ``at``: after
    that many tokens; ``at_end``: even when that is all of them (before the end events)."""

    kind: str
    at: int
    at_end: bool = False


@dataclass
class Faults:
    fail_health: bool = False          # /health answers 503 in the dialect's shape
    error_rate: float = 0.0            # share of generation requests answered with error_status
    error_status: int = 500            # 500 or 503
    stall_after: int | None = None     # stop emitting after N tokens, keep the connection open
    drop_after: int | None = None      # close the connection abruptly after N tokens
    error_after: int | None = None     # end the stream with an error event after N tokens
    break_rate: float = 0.0            # share of streams broken at a random point, a random way
    break_at_end: str | None = None    # break every stream so after its last token, before its end
    slowdown: float = 1.0              # every simulated delay is multiplied by this
    kv_garbage: int = 0                # KV events: malformed messages still to send
    kv_skip: int = 0                   # KV events: batches still to leave out of the live stream
    rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False, compare=False)

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self.rng.random() < self.error_rate

    def stream_break(self, tokens: int) -> Break | None:
        """Where a stream of ``tokens`` tokens breaks, if it does: the earliest fault set,
        else one drawn at ``break_rate``."""
        set_ = [Break(kind, at) for kind, at in (("stall", self.stall_after),
                                                  ("drop", self.drop_after),
                                                  ("error", self.error_after)) if at is not None]
        if set_:
            return min(set_, key=lambda b: b.at)
        if self.break_at_end is not None:
            return Break(self.break_at_end, tokens, True)
        if self.break_rate > 0 and self.rng.random() < self.break_rate:
            return Break(self.rng.choice(BREAK_KINDS), self.rng.randint(1, max(tokens, 1)), True)
        return None

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
    number("break_rate", 0.0, 1.0)
    if values["break_at_end"] not in (None, *BREAK_KINDS):
        raise FaultError(f"break_at_end must be null or one of {', '.join(BREAK_KINDS)}")
    if values["error_status"] not in (500, 503):
        raise FaultError("error_status must be 500 or 503")
    for name in ("kv_garbage", "kv_skip"):
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FaultError(f"{name} must be a non-negative integer")
    for name in ("stall_after", "drop_after", "error_after"):
        v = values[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise FaultError(f"{name} must be null or a non-negative integer")
    number("slowdown", 0.0)
    if values["slowdown"] <= 0:
        raise FaultError("slowdown must be > 0")
