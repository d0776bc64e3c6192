"""Admission and placement of a set of models, wired as the gateway wires them, for the tests
that drive them directly (no HTTP)."""

from __future__ import annotations

from typing import Any, Sequence

from gateway.balance.ledger import LoadLedger
from gateway.balance.output_estimate import OutputEstimate
from gateway.balance.policy import Policy
from gateway.balance.pool_split import PoolSplit
from gateway.config import BackpressureConfig, FlowControlConfig
from gateway.dataplane.admission import Admission, Admitter
from gateway.dataplane.placement import Placement, PlacementRequest, Placer
from gateway.fleet.replica import Replica
from gateway.fleet.model import ServedModel
from gateway.protocol.request import GenerationRequest


class Routing:
    def __init__(self, models: dict[str, ServedModel], policy: Policy, ledger: LoadLedger,
                 backpressure: BackpressureConfig = BackpressureConfig(),
                 split: PoolSplit | None = None, outputs: OutputEstimate | None = None,
                 flow: FlowControlConfig = FlowControlConfig(), **placer: Any) -> None:
        split = split or PoolSplit()
        self.models, self.ledger = models, ledger
        self.admitter = Admitter(models, None, split)
        self.placer = Placer(policy, ledger, backpressure, split=split, outputs=outputs,
                             flow=flow, **placer)

    def admit(self, request: GenerationRequest) -> tuple[ServedModel, Admission]:
        return self.admitter.admit(request)

    async def place(self, model: ServedModel, admission: Admission,
                    exclude: Sequence[Replica] = (), **ask: Any) -> Placement:
        """``Placer.place`` with its request's fields as arguments."""
        return await self.placer.place(PlacementRequest(model, admission,
                                                        exclude=tuple(exclude), **ask))

    def queued(self, model: str) -> int:
        return self.placer.queued(model)
