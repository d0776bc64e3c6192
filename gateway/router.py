"""model name -> model -> pool -> replica, with the request's cost reserved in the ledger."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gateway.balance.ledger import Lease, LoadLedger
from gateway.balance.policy import Policy
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.errors import Api, ApiNotServed, ModelNotFound, NoReplicaAvailable
from gateway.protocol.request import GenerationRequest
from gateway.window import admit


@dataclass(slots=True)
class Placement:
    """Where one request goes, and its reservation there (close the lease when done)."""

    model: ServedModel
    replica: Replica
    lease: Lease


class Router:
    def __init__(self, models: dict[str, ServedModel], default_model: str | None,
                 policy: Policy, ledger: LoadLedger, rng: random.Random | None = None) -> None:
        self.models = models
        self.default_model = default_model or (next(iter(models)) if len(models) == 1 else None)
        self.policy = policy
        self.ledger = ledger
        self.rng = rng or random.Random()

    def model_for(self, name: str | None, api: Api) -> ServedModel:
        """The named model; TGI requests (no name) and nameless OpenAI ones get the default."""
        if name is None or (api is Api.TGI and name not in self.models):
            name = self.default_model
            if name is None:
                raise ModelNotFound("(none given; several models are served, name one)")
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(name)
        return model

    def place(self, request: GenerationRequest) -> Placement:
        """Pick a replica for ``request`` and reserve its cost; raise a GatewayError if none."""
        model = self.model_for(request.model, request.api)
        speakers = [r for r in model.replicas if r.speaks(request.api)]
        if not speakers:
            engines = sorted({r.engine for r in model.replicas})
            raise ApiNotServed(f"model `{model.name}` is served only by {', '.join(engines)} "
                               f"replicas, which do not speak the {request.api.value} API")
        admission = admit(model, request, speakers)
        eligible = {id(r) for r in admission.replicas if r.available}
        pool = self._pick_pool(model.pools, eligible)
        if pool is None:
            raise NoReplicaAvailable(f"no available replica of model `{model.name}` can take "
                                     f"this request now")
        candidates = [r for r in pool.replicas if id(r) in eligible]
        replica = self.policy.select(candidates, admission.cost, self.ledger)
        lease = self.ledger.lease(replica.name, admission.cost.prompt_tokens,
                                  admission.cost.output_tokens)
        return Placement(model, replica, lease)

    def _pick_pool(self, pools: list[Pool], eligible: set[int]) -> Pool | None:
        """A pool with an eligible replica, drawn by weight (canary splits)."""
        usable = [p for p in pools if any(id(r) in eligible for r in p.replicas)]
        if len(usable) <= 1:
            return usable[0] if usable else None
        weights = [p.weight for p in usable]
        if sum(weights) <= 0:
            return self.rng.choice(usable)
        return self.rng.choices(usable, weights)[0]
