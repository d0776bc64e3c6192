"""vLLM V1's scheduling rules in the third timing model (gateway/sim/vllm_v1.py): the token
budget, chunked prefill beside decodes, whole-prompt admission, block-hash prefix hits, LRU
eviction and preemption by recompute. Pure model, simulated time only."""

from __future__ import annotations

from gateway.sim.engine import make_scheduler
from gateway.sim.scheduler import Sequence, block_hashes
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import PROFILES, Profile
from gateway.sim.vllm_v1 import BlockPool, V1Scheduler

V1 = Profile(name="v1-test", kind="vllm-v1", summary="test", step_base_s=0.010,
             per_token_s=0.0001, per_seq_s=0.001, max_batched_tokens=64,
             kv_capacity_tokens=16 * 64, max_running_seqs=8, block_size=16)


def sched(prefix_cache: bool = False, **overrides) -> V1Scheduler:
    s = make_scheduler(V1.with_overrides(**overrides), make_meter("vllm", 4096), prefix_cache)
    assert isinstance(s, V1Scheduler)
    return s


def seq(prompt: int, out: int, first_id: int = 0) -> Sequence:
    return Sequence(prompt, out, block_hashes=block_hashes(range(first_id, first_id + prompt), 16))


def step_until(s: V1Scheduler, done, now: float = 0.0) -> tuple[float, float]:
    """Steps until ``done()``; returns the time and the last step's duration."""
    d = 0.0
    while not done():
        d, _ = s.step(now)
        now += d
    return now, d


def two_racing_for_blocks(s: V1Scheduler, out: int) -> tuple[Sequence, Sequence, float]:
    """Two 40-token prompts admitted together; steps until one is preempted."""
    old, young = seq(40, out), seq(40, out, first_id=500)
    s.add(old, 0.0)
    s.add(young, 0.0)
    now, _ = step_until(s, lambda: s.meter.preemptions)
    return old, young, now


def run(s: V1Scheduler, now: float = 0.0) -> float:
    while not s.idle():
        d, _ = s.step(now)
        assert d > 0
        now += d
    return now


def test_a_long_prompt_is_chunked_to_the_token_budget() -> None:
    s = sched()
    a = seq(150, 2)
    s.add(a, 0.0)
    for computed in (64, 128):
        d, emitted = s.step(0.0)
        assert a.computed == computed and emitted == []
        assert abs(d - (0.010 + 64 * 0.0001 + 0.001)) < 1e-12  # base + 64 tokens + 1 request
    d, emitted = s.step(0.0)  # the last 22 tokens; the first token is sampled
    assert emitted == [a] and a.generated == 1
    assert abs(d - (0.010 + 22 * 0.0001 + 0.001)) < 1e-12


def test_running_requests_go_first_and_a_waiting_prompt_takes_what_is_left() -> None:
    s = sched()
    decoders = [seq(10, 50, first_id=1000 * k) for k in range(3)]
    for q in decoders:
        s.add(q, 0.0)
    s.step(0.0)  # the three prefills
    assert all(q.generated == 1 for q in decoders)
    late = seq(100, 5)
    s.add(late, 0.0)
    d, emitted = s.step(0.0)
    # three decode tokens, then 61 of the new prompt's 100 in the same step
    assert set(emitted) == set(decoders) and late.computed == 61
    assert abs(d - (0.010 + 64 * 0.0001 + 4 * 0.001)) < 1e-12


def test_max_num_seqs_bounds_the_running_requests() -> None:
    s = sched(max_running_seqs=2, max_batched_tokens=1024)
    for k in range(3):
        s.add(seq(10, 5, first_id=100 * k), 0.0)
    s.step(0.0)
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_a_waiting_request_is_admitted_only_if_its_whole_prompt_fits() -> None:
    s = sched(kv_capacity_tokens=16 * 10)  # 10 blocks
    big = seq(100, 200)  # 7 blocks of prompt
    s.add(big, 0.0)
    s.step(0.0)
    s.step(0.0)
    assert big in s.running
    head = seq(60, 5, first_id=500)  # 4 blocks: only 3 are free
    behind = seq(10, 5, first_id=900)  # 1 block would fit, but FCFS stops at the head
    s.add(head, 0.0)
    s.add(behind, 0.0)
    s.step(0.0)
    assert list(s.waiting) == [head, behind] and head.computed == 0


def test_prefix_hits_skip_whole_cached_blocks_and_never_the_last_token() -> None:
    s = sched(prefix_cache=True, max_batched_tokens=1024)
    first = seq(100, 1)  # 6 full blocks of 16 hashed
    s.add(first, 0.0)
    run(s)
    again = seq(100, 1)
    s.add(again, 0.0)
    s.step(0.0)
    assert again.cached == 96 and s.meter.prefix_hits == 96
    exact = seq(96, 1)  # whole prompt cached: the last block is recomputed for its logits
    s.add(exact, 0.0)
    s.step(0.0)
    assert exact.cached == 80
    other = seq(100, 1, first_id=7)  # another first block: no hit at all
    s.add(other, 0.0)
    s.step(0.0)
    assert other.cached == 0


def test_prefix_hit_costs_only_the_uncached_tokens() -> None:
    cold, warm = sched(prefix_cache=True), sched(prefix_cache=True)
    warm.add(seq(100, 1), 0.0)
    run(warm)
    a, b = seq(100, 1), seq(100, 1)
    cold.add(a, 0.0)
    warm.add(b, 0.0)
    assert run(cold) > 2 * run(warm)  # two chunks and a half against 4 tokens


def test_free_blocks_keep_their_hashes_until_reused_oldest_first() -> None:
    pool = BlockPool(4, caching=True)
    a, b = pool.take(2), pool.take(2)
    for blocks, base in ((a, 10), (b, 20)):
        for k, block in enumerate(blocks):
            pool.cache(block, base + k)
    pool.release(a)
    pool.release(b)
    assert pool.num_free() == 4 and pool.longest_hit((10, 11), 2) == a
    pool.take(1)  # evicts the oldest freed: a's last block went first (freed tail first)
    assert pool.longest_hit((10, 11), 2) == [a[0]] and pool.longest_hit((20, 21), 2) == b
    hit = pool.longest_hit((20, 21), 2)
    pool.touch(hit)  # a hit on a free cached block takes it out of the free queue
    assert pool.num_free() == 1


def test_a_request_that_runs_out_of_blocks_preempts_the_last_admitted() -> None:
    s = sched(kv_capacity_tokens=16 * 6, max_batched_tokens=256)  # 6 blocks
    old, young, now = two_racing_for_blocks(s, 40)  # 3 blocks each, 5 at the end
    # old's 49th token needed a 4th block: young was preempted, its computation lost
    assert old in s.running and young.computed == 0 and s.meter.preemptions == 1
    assert old.computed == 49 and young.generated == 9  # young held 48 computed tokens
    run(s, now)
    assert s.completed == 2 and young.generated == 40 and s.kv_used == 0


def test_a_preempted_request_recomputes_only_what_was_evicted() -> None:
    s = sched(prefix_cache=True, kv_capacity_tokens=16 * 12, max_batched_tokens=256)
    old, young, now = two_racing_for_blocks(s, 100)  # 9 blocks each at the end
    # Both held 6 blocks (12); old's 97th token needed a 7th: young (97 tokens, 6 full
    # blocks cached) was preempted. It cannot come back while old holds more than 6 blocks.
    held = young.prompt_tokens + young.generated
    assert held == 97 and s.meter.preemptions == 1
    now, d = step_until(s, lambda: young in s.running, now)
    # Old took 3 more blocks from the head of the free queue, young's last three (a request's
    # tail is freed first); young's first 3 blocks were still cached: 97 - 48 recomputed.
    tokens = round((d - 0.010 - 0.001) / 0.0001)
    assert tokens == 97 - 48 and old.finished
    run(s, now)
    assert s.completed == 2 and young.generated == 100


def test_kv_use_stays_within_capacity_under_overload() -> None:
    s = sched(kv_capacity_tokens=16 * 20, max_batched_tokens=128, prefix_cache=True)
    for k in range(30):
        s.add(seq(30 + 7 * k % 90, 20 + k % 40, first_id=1000 * (k % 4)), 0.0)
    now = 0.0
    while not s.idle():
        d, _ = s.step(now)
        now += d
        assert s.kv_used <= 16 * 20 and len(s.running) <= 8
    assert s.completed == 30 and s.pool.num_free() == 20


def test_abort_returns_blocks_at_once() -> None:
    s = sched()
    a = seq(40, 50)
    s.add(a, 0.0)
    s.step(0.0)
    assert s.kv_used == 48
    s.abort(a, 0.1)
    assert s.kv_used == 0 and s.aborted == 1 and a.done and s.idle()


def test_the_fitted_profile_runs_a_closed_loop() -> None:
    from gateway.sim.calibrate import closed_loop
    profile = next(p for p in PROFILES.values() if p.kind == "vllm-v1")
    few = closed_loop(profile, 4, 512, 128, duration_s=30, warmup_s=5)
    many = closed_loop(profile, 64, 512, 128, duration_s=30, warmup_s=5)
    assert many.output_tokens_per_s > 4 * few.output_tokens_per_s


def test_a_disaggregated_decode_computes_only_the_last_prompt_token() -> None:
    """KV loaded from a prefill engine (``external_tokens``) is admitted as computed: one
    token is computed, for its logits, in the first step; the whole prompt's blocks are held;
    vLLM's prefix-cache stats count local hits only, and the meter counts one context token."""
    s = sched(prefix_cache=True)
    remote = Sequence(150, 3, block_hashes=block_hashes(range(150), 16), external_tokens=150)
    s.add(remote, 0.0)
    d, emitted = s.step(0.0)
    assert emitted == [remote] and remote.generated == 1
    assert abs(d - (0.010 + 0.0001 + 0.001)) < 1e-12  # 1 token, 1 request: not 64 + 64 + 22
    assert s.kv_used == 160  # the whole prompt's blocks: ceil(150 / 16)
    assert s.meter.prefix_hits == 0 and s.meter.prefill_tokens == 1
    run(s)
    local = seq(100, 2, first_id=1000)
    s.add(local, 0.0)
    run(s)
    assert s.meter.prefill_tokens == 1 + 100  # decodes are not context; a local prompt is
