"""What the admin routes may read and change of a running gateway: a narrow view, built at
wiring (gateway/app.py), instead of the whole ``Gateway`` and its thirty-odd attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fastapi import Request

from gateway.access.control import AccessControl
from gateway.balance.ledger import ReplicaLoad
from gateway.canary.agreement import Agreement
from gateway.canary.sample_source import SampleSource
from gateway.canary.weights import PoolWeights
from gateway.canary.config import CanaryConfig
from gateway.fleet.membership import Fleet


@dataclass(frozen=True)
class AdminView:
    admin_token: str | None                    # None: every admin route answers 404
    gate_token: str | None                     # reads canary verdicts only
    canary: CanaryConfig                       # the verdict's settings, auto_rollback
    redis_timeout: float                       # how long a weight change waits to be shared
    fleet: Fleet                               # models and replicas: listed, added, removed
    load: Callable[[str], ReplicaLoad]         # a replica's load, as the ledger holds it
    weights: PoolWeights                       # pools' run-time weights
    samples: SampleSource                      # the verdict's records
    rollbacks: Mapping[str, list[dict[str, Any]]]  # the guard's, per model
    agreement: Agreement                       # shadowed pairs and their disagreements
    access: AccessControl                      # API keys
    activity: Callable[[], dict[str, Any]]     # what is inside now (requests, copies, queues)


def admin_view(request: Request) -> AdminView:
    """The view the app was wired with."""
    return request.app.state.admin
