"""A request's priority and latency objectives: from its headers, else its API key's
defaults, else its model's, else priority 0 and none.

- ``x-gateway-priority``: an integer band (``gateway.balance.fair_queue``); negative bands are
  sheddable (refused with a 429 while the model's replicas are saturated). A key may not ask
  for more than its ``max_priority`` (its default priority unless set): a 403.
- ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (or llm-d's ``x-llm-d-slo-ttft-ms`` /
  ``x-llm-d-slo-tpot-ms``): time to first token and time per output token the client wants.
  Placement prefers a replica predicted to meet them.
- ``x-slo-strict: true``: refuse (429) instead of serving best-effort when no replica is
  predicted to meet them.
- ``x-llm-d-inference-objective: NAME`` (or ``x-gateway-inference-objective``): the config's
  ``objectives`` entry NAME (an InferenceObjective's priority, and objectives) gives the
  defaults, before the key's and the model's; a name the config does not have gives none
  (as llm-d serves a request naming an objective not created yet).

A header that is not a number, or is out of range, is a 400 naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, TypeVar

from gateway.protocol.errors import GatewayError, InvalidRequest
from gateway.protocol.reasons import Reason

if TYPE_CHECKING:  # the request's own module imports this one: no config at import
    from gateway.config import ObjectiveConfig

PRIORITY_HEADER = b"x-gateway-priority"
TTFT_HEADER = b"x-slo-ttft-ms"
TPOT_HEADER = b"x-slo-tpot-ms"
STRICT_HEADER = b"x-slo-strict"
# llm-d's names for the same (its router reads both, as this gateway does).
LLMD_TTFT_HEADER = b"x-llm-d-slo-ttft-ms"
LLMD_TPOT_HEADER = b"x-llm-d-slo-tpot-ms"
# An InferenceObjective by name (llm-d's, and the Inference Extension's older name): the
# gateway's `objectives` entry of that name gives the request's defaults.
OBJECTIVE_NAME_HEADERS = (b"x-llm-d-inference-objective", b"x-gateway-inference-objective")
MAX_OBJECTIVE_NAME = 253  # a Kubernetes object name
MAX_PRIORITY = 100  # bands are -100..100
MAX_OBJECTIVE_MS = 3_600_000.0  # an hour
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Objective:
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    strict: bool = False  # refuse rather than serve best-effort when no replica can meet it

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    @property
    def timed(self) -> bool:
        """It has a latency objective (placement predicts for it)."""
        return self.ttft_ms is not None or self.tpot_ms is not None


DEFAULT_OBJECTIVE = Objective()


class ObjectiveHeaders(NamedTuple):
    """The headers as sent (read in the edge's one pass over them)."""

    priority: bytes | None = None
    ttft_ms: bytes | None = None
    tpot_ms: bytes | None = None
    strict: bytes | None = None
    ttft_header: bytes = TTFT_HEADER  # the names they came under (a 400 names the one sent)
    tpot_header: bytes = TPOT_HEADER


NO_HEADERS = ObjectiveHeaders()


class PriorityNotAllowed(GatewayError):
    status = 403
    reason = Reason.PRIORITY_NOT_ALLOWED
    openai_type = "permission_error"


def resolve(headers: ObjectiveHeaders, key: "ObjectiveConfig | None",
            max_priority: int | None, model: "ObjectiveConfig | None",
            named: "ObjectiveConfig | None" = None) -> Objective:
    """The request's objective. ``key``: its API key's defaults; ``max_priority``: the highest
    priority the key may ask for (None: keys are off, any in range may be asked); ``model``:
    the model's defaults; ``named``: the objective the request named (an InferenceObjective,
    by ``x-llm-d-inference-objective``), before the key's and the model's."""
    if headers is NO_HEADERS and key is None and model is None and named is None:
        return DEFAULT_OBJECTIVE
    defaults = [c for c in (named, key, model) if c is not None]
    default_priority = next((c.priority for c in defaults if c.priority is not None), 0)
    priority = default_priority
    if named is not None and named.priority is not None and max_priority is not None and \
            named.priority > max_priority:  # a name is no way around the key's ceiling
        raise PriorityNotAllowed(f"this API key may not ask for a priority above "
                                 f"{max_priority} (the objective it names has "
                                 f"{named.priority})")
    if headers.priority is not None:
        priority = _integer(headers.priority, PRIORITY_HEADER)
        if max_priority is not None and priority > max_priority:
            raise PriorityNotAllowed(f"this API key may not ask for a priority above "
                                     f"{max_priority} (`x-gateway-priority: {priority}`)")
    ttft = _milliseconds(headers.ttft_ms, headers.ttft_header) if headers.ttft_ms is not None \
        else next((c.ttft_ms for c in defaults if c.ttft_ms is not None), None)
    tpot = _milliseconds(headers.tpot_ms, headers.tpot_header) if headers.tpot_ms is not None \
        else next((c.tpot_ms for c in defaults if c.tpot_ms is not None), None)
    strict = headers.strict is not None and _flag(headers.strict, STRICT_HEADER)
    return Objective(priority, ttft, tpot, strict)


def _parsed(raw: bytes, header: bytes, convert: Callable[[bytes], T], what: str) -> T:
    try:
        return convert(raw.strip())
    except ValueError:
        raise InvalidRequest(f"header `{header.decode()}` must be {what}, got "
                             f"{raw[:40].decode('latin-1')!r}", param=header.decode()) from None


def _integer(raw: bytes, header: bytes) -> int:
    value = _parsed(raw, header, int, "an integer")
    if abs(value) > MAX_PRIORITY:
        raise InvalidRequest(f"header `{header.decode()}` must be between {-MAX_PRIORITY} "
                             f"and {MAX_PRIORITY}, got {value}", param=header.decode())
    return value


def _milliseconds(raw: bytes, header: bytes) -> float:
    value = _parsed(raw, header, float, "a number of milliseconds")
    if not math.isfinite(value) or not 0 < value <= MAX_OBJECTIVE_MS:
        raise InvalidRequest(f"header `{header.decode()}` must be more than 0 and at most "
                             f"{MAX_OBJECTIVE_MS:.0f} ms, got {raw[:40].decode('latin-1')}",
                             param=header.decode())
    return value


def _flag(raw: bytes, header: bytes) -> bool:
    value = raw.strip().lower()
    if value in (b"true", b"1"):
        return True
    if value in (b"false", b"0"):
        return False
    name = header.decode()
    raise InvalidRequest(f"header `{name}` must be true or false, got "
                         f"{raw[:40].decode('latin-1')!r}", param=name)
