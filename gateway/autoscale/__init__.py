"""What the autoscaler should do, from the gateway's own view (docs/autoscaling.md).

- ``signal``: how many replicas a pool needs (Little's law at the latency model's operating
  point), smoothed so it does not flap;
- ``demand``: what was offered lately (arrivals, tokens, how long requests took);
- ``autoscaler``: the signal of every model, pool and role, from the fleet, the ledger and
  the placer's latency models;
- ``candidate``: which replica to remove when fewer are wanted;
- ``hold``: scale from zero: requests for a model with no replica wait for one to appear.
"""
