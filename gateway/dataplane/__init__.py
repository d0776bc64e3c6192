"""The data path: one request's way from the HTTP edge to a replica and back, in order.

1. ``admission``: its model, the replicas that can serve it (dialect, pool, context window),
   and what it will cost them (``Admitter.admit``).
2. ``placement``: a replica with a free slot, picked by the balancing policy, its cost
   reserved in the ledger; or a wait in the model's fair queue (``Placer.place``).
3. ``attempts``: the retry loop; a failure that reached no client byte tries another replica
   (``Attempts.serve``), and a served primary request starts its canary shadow copies.
4. ``relay``: one attempt sent through its translation (``gateway.protocol.translate``),
   its answer streamed back and metered, its lease released (``Relay.forward``).
5. ``outcome``: how the attempt went, told once to the listeners registered at wiring
   (``listeners``: metrics, outlier detection, canary samples, output lengths).

``gateway.api.generation`` is the HTTP edge around it; ``gateway.app`` wires it.
"""
