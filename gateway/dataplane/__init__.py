"""The data path: one request's way from the HTTP edge to a replica and back, in order.
The parsed request (``GenerationRequest``) is never written: with it goes the edge's
``Context`` (session, forced pool, caller), and each stage returns what it decided.

1. ``admission``: its model, the replicas that can serve it (dialect, pool, context window),
   what it will cost them and any output cap (``Admitter.admit`` -> ``Admission``).
2. ``placement``: a replica with a free slot, picked by the balancing policy, its cost
   reserved in the ledger; or a wait in the model's fair queue (``Placer.place``).
3. ``attempts``: the retry loop; a failure that reached no client byte tries another replica
   (``Attempts.serve``) when its failure kind is retryable (``gateway.upstream.failure``),
   and a served primary request starts its canary shadow copies.
4. ``relay``: one attempt sent through its translation (``gateway.protocol.translate``),
   which writes the engine's body (the output cap included), its answer streamed back and
   metered, its lease released (``Relay.forward``).
5. ``outcome``: how the attempt went (and whether a retry followed), told to the listeners
   registered at wiring (``listeners``: metrics, outlier detection, canary samples, output
   lengths, where stored Responses live); the edge tells them of each client request too.

``gateway.api.generation`` is the HTTP edge around it; ``gateway.app`` wires it.
"""
