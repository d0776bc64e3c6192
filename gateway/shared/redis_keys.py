"""Where everything the gateway shares through Redis lives: one prefix, one layout.

Every key starts with the configurable prefix (default ``llm-gateway:``), so several
gateways (or several environments) can share one Redis without seeing each other. For Redis
Cluster put a hash tag in the prefix (``{llm-gateway}:``): the sync scripts touch several keys
and need them in one slot.

=====================================  ======  =========================================
key                                    type    what
=====================================  ======  =========================================
``{p}instances``                       zset    live gateway instances; score = heartbeat
                                               expiry (Redis server clock, ms)
``{p}load:{instance}``                 hash    that instance's own load: replica ->
                                               ``"<outstanding_tokens> <in_flight>``
                                               ``<prefill_tokens>"`` (non-zero replicas
                                               only; expires with the instance's
                                               heartbeat)
``{p}load-events``                     pubsub  an instance id, published when its load
                                               changed enough that peers should re-read now
``{p}replica:ejected_until``           hash    replica -> wall-clock end of its outlier
                                               ejection (merged by max)
``{p}replica:draining``                hash    replica -> ``"1"``/``"0"`` (admin drain;
                                               persists until undrained)
``{p}canary:weights``                  hash    ``"<model>\t<pool>"`` -> weight set at run
                                               time (admin API, canary guard); persists
``{p}canary:samples:{model}:{pool}``   list    the fleet's latest requests of a pool, for
                                               the canary verdict (bounded, oldest
                                               trimmed; model and pool URL-quoted)
``{p}canary:pairs:{model}:{pool}``     list    the same for a shadow pool's compared pairs
``{p}canary:rollout:{model}``          hash    the rollout driver's state (step, started,
                                               state); kept after it ends
``{p}canary:rollout-lock:{model}``     string  the running driver's id; expires unless it
                                               renews it (a second driver refuses)
``{p}ratelimit:{key name}``            hash    an API key's buckets: requests and tokens
                                               left and when (gateway/access/redis_limits)
``{p}ratelimit:{key name}:leases``     zset    its requests in flight; score = lease expiry
``{p}access:keys``                     hash    admin-created API keys: name -> JSON (sha256,
                                               models, weight, limits; never the secret)
``{p}access:events``                   pubsub  a key name, published when a key is created
                                               or revoked (peers re-read at once)
``{p}response:{id}``                   string  the replica that stored a Response (vLLM keeps
                                               it in its process); expires after
                                               ``responses.ttl`` (gateway/fleet/
                                               response_homes)
=====================================  ======  =========================================

Pub/sub channels are not per database: gateways that share one Redis under different DB
numbers need different prefixes too (else they only wake each other needlessly).

Replica *health* is deliberately not shared: every instance probes every replica itself,
and a replica reachable from one instance but not another must stay usable where it works.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True, slots=True)
class SharedKeys:
    prefix: str = "llm-gateway:"

    @property
    def instances(self) -> str:
        return f"{self.prefix}instances"

    @property
    def load_prefix(self) -> str:
        return f"{self.prefix}load:"

    def load(self, instance: str) -> str:
        return f"{self.load_prefix}{instance}"

    @property
    def load_events(self) -> str:
        return f"{self.prefix}load-events"

    @property
    def replica_ejected_until(self) -> str:
        return f"{self.prefix}replica:ejected_until"

    @property
    def replica_draining(self) -> str:
        return f"{self.prefix}replica:draining"

    @property
    def canary_weights(self) -> str:
        return f"{self.prefix}canary:weights"

    def canary_samples(self, model: str, pool: str) -> str:
        return f"{self.prefix}canary:samples:{quote(model, safe='')}:{quote(pool, safe='')}"

    def canary_pairs(self, model: str, pool: str) -> str:
        return f"{self.prefix}canary:pairs:{quote(model, safe='')}:{quote(pool, safe='')}"

    def canary_rollout(self, model: str) -> str:
        return f"{self.prefix}canary:rollout:{quote(model, safe='')}"

    def canary_rollout_lock(self, model: str) -> str:
        return f"{self.prefix}canary:rollout-lock:{quote(model, safe='')}"

    def response_home(self, response_id: str) -> str:
        return f"{self.prefix}response:{quote(response_id, safe='')}"

    def rate_limit(self, key_name: str) -> str:
        return f"{self.prefix}ratelimit:{key_name}"

    def rate_limit_leases(self, key_name: str) -> str:
        return f"{self.prefix}ratelimit:{key_name}:leases"

    @property
    def access_keys(self) -> str:
        return f"{self.prefix}access:keys"

    @property
    def access_events(self) -> str:
        return f"{self.prefix}access:events"
