"""Flow control: what a request's priority and latency objectives are (``objective``),
when a replica is saturated so requests wait at the gateway instead (``saturation``), and
how long a replica is predicted to take to answer (``latency_model``). Placement
(``gateway.dataplane.placement``) and the fair queue's bands (``gateway.balance.fair_queue``)
use them; ``metrics`` counts the objectives met."""
