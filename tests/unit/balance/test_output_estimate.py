"""Expected output lengths: learned per model and max_tokens band, reserved in the ledger
instead of the whole ask, renewed while a request runs past them, never past the ask."""

from __future__ import annotations

import asyncio

from gateway.balance.ledger import InProcessLedger
from gateway.balance.output_estimate import MIN_SEEN, OutputEstimate
from gateway.balance.policy import make_policy
from gateway.config import BackpressureConfig
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol.openai import parse_completion
from routing import Routing


def test_a_band_expects_the_whole_ask_until_it_has_seen_enough() -> None:
    outputs = OutputEstimate()
    for _ in range(MIN_SEEN - 1):
        outputs.observe("m", 4096, 200)
    assert outputs.expect("m", 4096) == 4096  # not trusted yet
    outputs.observe("m", 4096, 200)
    assert 190 <= outputs.expect("m", 4096) <= 210  # ~5% of the ask used
    assert 190 <= outputs.expect("m", 4500) <= 235  # the same band: 4,096-8,191
    assert outputs.expect("m", 3000) == 3000  # another band, nothing seen there
    assert outputs.expect("other", 4096) == 4096


def test_clients_that_ask_exactly_what_they_use_keep_their_asks() -> None:
    outputs = OutputEstimate()
    for asked in range(100, 100 + 3 * MIN_SEEN):
        outputs.observe("m", asked, asked)  # finish_reason length, every time
    assert all(outputs.expect("m", asked) == asked for asked in (64, 128, 150, 200))


def test_the_average_follows_lengths_that_drift() -> None:
    outputs = OutputEstimate()
    for _ in range(MIN_SEEN):
        outputs.observe("m", 1024, 100)
    for _ in range(200):
        outputs.observe("m", 1024, 600)
    assert 550 <= outputs.expect("m", 1024) <= 600
    outputs.observe("m", 1024, 10_000)  # an engine that overran: counts as the whole ask
    assert outputs.expect("m", 1024) <= 1024


def test_a_lease_renews_its_expectation_within_the_ask_and_returns_to_zero() -> None:
    ledger = InProcessLedger()
    lease = ledger.lease("a", 10, 100, asked=250)
    assert ledger.load("a").outstanding_tokens == 110
    lease.first_token()
    lease.generated(99)
    assert ledger.load("a").outstanding_tokens == 1
    lease.generated(1)  # its expectation used up, still going: as long again
    assert ledger.load("a").outstanding_tokens == 100
    lease.generated(103)  # 203 of 250: the rest of the ask is all it can still take
    assert ledger.load("a").outstanding_tokens == 47
    lease.generated(47)
    assert ledger.load("a").outstanding_tokens == 0
    lease.generated(5)  # an engine past max_tokens: nothing to release, nothing renewed
    assert ledger.load("a").outstanding_tokens == 0
    lease.close()
    assert ledger.load("a").outstanding_tokens == ledger.load("a").in_flight == 0


def test_the_router_reserves_the_expectation_and_learns_from_completions() -> None:
    replica = Replica("r0", "http://r0", "vllm", "m", "default", max_model_len=8192)
    model = ServedModel("m", [Pool("default", 100, [replica])], None, 8192, 16)
    ledger = InProcessLedger()
    router = Routing({"m": model}, make_policy("least_outstanding_tokens"), ledger,
                    BackpressureConfig(), outputs=OutputEstimate())
    request = parse_completion(b'{"model": "m", "prompt": "hi", "max_tokens": 4000}')

    async def serve(generated: int | None) -> int:
        _, admission = router.admit(request)
        placement = await router.place(model, admission)
        reserved = ledger.load("r0").outstanding_tokens - admission.cost.prompt_tokens
        placement.lease.close()
        if generated is not None:
            placement.served(generated)
        return reserved

    async def run() -> None:
        assert await serve(400) == 4000  # nothing known: the whole ask
        for _ in range(MIN_SEEN):
            await serve(None)  # failed or cut short: they teach nothing
        assert await serve(400) == 4000
        for _ in range(MIN_SEEN):
            await serve(400)
        assert await serve(400) == 400  # 10% of the ask, as completions used

    asyncio.run(run())
