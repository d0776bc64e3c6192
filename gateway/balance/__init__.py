"""Balancing: the load ledger and the routing policies that read it.

``POLICIES`` names every policy (``balancer:`` in the config) and where it lives; adding a
policy is one new file and one line here (``policy.make_policy`` builds it).
"""

POLICIES = {
    "least_expected_work": "gateway.balance.least_expected_work:LeastExpectedWork",
    "least_outstanding_tokens": "gateway.balance.least_outstanding_tokens:LeastOutstandingTokens",
    "least_requests": "gateway.balance.least_requests:LeastRequests",
    "round_robin": "gateway.balance.round_robin:RoundRobin",
}
