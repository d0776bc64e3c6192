"""The ledger returns exactly to zero whatever path each request's life takes."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.balance.ledger import InProcessLedger, ReplicaLoad

REPLICAS = ["a", "b", "c"]

# One request's life: where it ends and how many tokens stream before that.
life = st.tuples(
    st.sampled_from(REPLICAS),
    st.integers(0, 5000),  # prompt tokens
    st.integers(0, 2000),  # expected output tokens
    st.sampled_from(["complete", "cancel_before_first", "cancel_mid_stream", "upstream_error",
                     "timeout", "overrun"]),
    st.integers(0, 3000),  # tokens streamed before the end
    st.booleans(),  # close called twice (e.g. error path and finally)
    st.integers(0, 3000),  # the ask beyond the expected output (learned expectations renew)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(life, min_size=1, max_size=60), st.randoms(use_true_random=False))
def test_random_request_lives_return_ledger_to_zero(lives, rnd: random.Random) -> None:
    ledger = InProcessLedger()
    leases = [ledger.lease(r, p, o, o + beyond) for r, p, o, *_, beyond in lives]
    expected = {r: 0 for r in REPLICAS}
    for r, p, o, *_ in lives:
        expected[r] += p + o
    assert {r: ledger.load(r).outstanding_tokens for r in REPLICAS} == expected
    # Interleave the lives' steps in random order, as concurrent requests do.
    steps = []
    for lease, (_, _, output, end, streamed, double_close, _) in zip(leases, lives):
        plan = []
        if end != "cancel_before_first":
            plan.append(("first", 0))
            n = streamed if end != "complete" else output
            if end == "overrun":
                n = output + streamed  # engine sent more than max_tokens claimed
            plan += [("gen", 1)] * min(n, 50) + ([("gen", n - 50)] if n > 50 else [])
        plan.append(("close", 0))
        if double_close:
            plan.append(("close", 0))
        steps.append((lease, plan))
    while steps:
        i = rnd.randrange(len(steps))
        lease, plan = steps[i]
        action, n = plan.pop(0)
        if action == "first":
            lease.first_token()
        elif action == "gen":
            lease.generated(n)
        else:
            lease.close()
            lease.generated(5)  # late events after close must not count
            lease.first_token()
        for r in REPLICAS:
            load = ledger.load(r)
            assert load.outstanding_tokens >= load.prefill_tokens >= 0
            assert load.in_flight >= 0
        if not plan:
            steps.pop(i)
    for r in REPLICAS:
        assert ledger.load(r).outstanding_tokens == 0
        assert ledger.load(r).in_flight == 0
        assert ledger.load(r).prefill_tokens == 0


def test_lease_releases_prompt_at_first_token_and_output_per_token() -> None:
    ledger = InProcessLedger()
    lease = ledger.lease("a", 100, 10)
    assert ledger.load("a") == ReplicaLoad(outstanding_tokens=110, in_flight=1, prefill_tokens=100)
    lease.first_token()
    assert ledger.load("a") == ReplicaLoad(10, 1, prefill_tokens=0)
    lease.generated(3)
    assert ledger.load("a").outstanding_tokens == 7
    lease.close()
    assert ledger.load("a") == ReplicaLoad(0, 0, 0)
    cancelled = ledger.lease("a", 50, 5)  # never prefilled: its prompt leaves at close
    cancelled.close()
    assert ledger.load("a") == ReplicaLoad(0, 0, 0)


def test_a_non_streamed_prompt_is_outstanding_but_not_waiting_for_its_prefill() -> None:
    """The gateway never sees a non-streamed answer's first token: its prompt counts in the
    outstanding tokens until it ends, never as prefill still to do (flow control's gate)."""
    ledger = InProcessLedger()
    streamed = ledger.lease("r", 1000, 50)
    whole = ledger.lease("r", 3000, 50, streamed=False)
    assert ledger.load("r") == ReplicaLoad(4100, 2, 1000)
    streamed.first_token()
    whole.first_token()  # (the P/D path calls it for either kind)
    assert ledger.load("r") == ReplicaLoad(100, 2, 0)
    streamed.close()
    whole.close()
    assert ledger.load("r") == ReplicaLoad(0, 0, 0)
    unread = ledger.lease("r", 3000, 50, streamed=False)
    unread.close()  # closed before any token
    assert ledger.load("r") == ReplicaLoad(0, 0, 0)
