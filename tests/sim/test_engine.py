"""The batching model in simulated time: no sockets, no sleeping, no wall-clock assertions."""

from __future__ import annotations

from gateway.sim.calibrate import closed_loop
from gateway.sim.scheduler import BatchScheduler, PrefixCache, Sequence, block_hashes
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import PROFILES, Profile

SMALL = Profile(name="small", kind="batched", summary="test GPU", step_base_s=0.010, decode_per_seq_s=0.001,
                prefill_per_token_s=0.0001, max_batched_tokens=2048, kv_capacity_tokens=100_000,
                max_running_seqs=32)


def test_throughput_rises_with_concurrency_then_saturates() -> None:
    tput = {u: closed_loop(SMALL, u, 256, 64, duration_s=60, warmup_s=10).output_tokens_per_s
            for u in (1, 4, 16, 32, 64, 128)}
    assert tput[1] < tput[4] < tput[16] < tput[32]
    assert tput[4] > 2.5 * tput[1]
    # past max_running_seqs more users only queue: throughput stays flat
    assert abs(tput[128] - tput[64]) / tput[64] < 0.05 and abs(tput[64] - tput[32]) / tput[32] < 0.1


def test_ttft_grows_once_kv_is_full() -> None:
    tight = SMALL.with_overrides(kv_capacity_tokens=4 * 330)  # room for about 4 sequences of 256+64
    few = closed_loop(tight, 3, 256, 64, duration_s=60, warmup_s=10)
    many = closed_loop(tight, 16, 256, 64, duration_s=60, warmup_s=10)
    assert many.ttft_p50_s > 5 * few.ttft_p50_s
    assert abs(many.output_tokens_per_s - closed_loop(tight, 8, 256, 64, 60, 10).output_tokens_per_s) \
        < 0.1 * many.output_tokens_per_s  # the KV cache, not the users, bounds throughput


def test_requests_queue_while_kv_is_full() -> None:
    meter = make_meter("vllm", 4096)
    s = BatchScheduler(SMALL.with_overrides(kv_capacity_tokens=1000), meter)
    seqs = [Sequence(400, 50) for _ in range(4)]
    for q in seqs:
        s.add(q, 0.0)
    s.step(0.0)
    assert len(s.running) == 2 and len(s.waiting) == 2 and s.kv_used <= 1000
    now = 0.0
    while not s.idle():
        d, _ = s.step(now)
        now += d
        assert s.kv_used <= 1000
    assert s.completed == 4 and meter.finished["length"] == 4 and meter.generation_tokens == 200


def test_preemption_keeps_kv_within_capacity() -> None:
    meter = make_meter("vllm", 4096)
    s = BatchScheduler(SMALL.with_overrides(kv_capacity_tokens=300), meter)
    for _ in range(3):
        s.add(Sequence(50, 200), 0.0)
    now = 0.0
    while not s.idle():
        d, _ = s.step(now)
        now += d
        assert s.kv_used <= 301
    assert s.completed == 3 and meter.preemptions > 0 and meter.generation_tokens == 600


def test_abort_frees_slot_and_kv_at_once() -> None:
    meter = make_meter("vllm", 4096)
    s = BatchScheduler(SMALL, meter)
    a, b = Sequence(100, 50), Sequence(100, 50)
    s.add(a, 0.0)
    s.add(b, 0.0)
    s.step(0.0)
    s.step(0.1)
    held_by_a = a.held
    before = s.kv_used
    s.abort(a, 0.2)
    assert s.running == [b] and s.kv_used == before - held_by_a and a.held == 0 and a.done
    assert s.kv_used == b.held and meter.finished["abort"] == 1 and s.aborted == 1
    w = Sequence(10, 5)
    s.add(w, 0.3)
    s.abort(w, 0.3)  # aborting a waiting sequence removes it from the queue
    assert not s.waiting and s.aborted == 2


def test_prefix_cache_lowers_ttft() -> None:
    p = PROFILES["llama3-8b-a100"]
    cold = closed_loop(p, 4, 2048, 32, duration_s=30, warmup_s=5, shared_prefix=1900, prefix_cache=False)
    warm = closed_loop(p, 4, 2048, 32, duration_s=30, warmup_s=5, shared_prefix=1900, prefix_cache=True)
    assert warm.ttft_p50_s < 0.5 * cold.ttft_p50_s


def test_prefix_cache_is_lru_and_bounded() -> None:
    cache = PrefixCache(capacity_tokens=64, block_size=16)  # 4 blocks
    a = block_hashes(list(range(48)), 16)
    b = block_hashes(list(range(100, 148)), 16)
    cache.insert(a)
    assert cache.match(a) == 48 and cache.match(block_hashes(list(range(40)), 16)) == 32
    cache.insert(b)
    assert len(cache.blocks) == 4 and cache.match(b) == 48 and cache.match(a) < 48
    assert cache.match(block_hashes([7] + list(range(1, 48)), 16)) == 0  # a different first block shares nothing


def test_a100_profile_matches_published_figures() -> None:
    r = closed_loop(PROFILES["llama3-8b-a100"], 100, 512, 256, duration_s=60, warmup_s=20)
    assert 2200 <= r.output_tokens_per_s <= 2600  # BentoML 2024: vLLM ~2,300-2,500 tok/s at 100 users
    one = closed_loop(PROFILES["llama3-8b-a100"], 1, 512, 256, duration_s=30, warmup_s=5)
    assert 0.015 <= one.ttft_p50_s <= 0.05  # low tens of ms at low load
    fast = closed_loop(PROFILES["llama3-8b-a100-fast"], 100, 512, 256, duration_s=60, warmup_s=20)
    assert 3700 <= fast.output_tokens_per_s <= 4300
