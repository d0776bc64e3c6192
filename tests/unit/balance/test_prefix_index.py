"""The prefix index: chained block hashes of prompts, LRU per replica, bounded memory; and what
the window check hands the balancer (prefix blocks, session)."""

from __future__ import annotations

from gateway.balance.policy import RequestCost  # noqa: F401  (policy registry before window)
from gateway.balance.prefix_index import (BLOCK_BYTES, MAX_PROMPT_BLOCKS, PrefixIndex,
                                          prompt_blocks, token_blocks)
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.protocol import openai
from gateway.dataplane.admission import admit

SYSTEM = "You are a careful assistant. " * 40  # ~1.1 KB: four full blocks


def test_equal_prefixes_share_leading_blocks_and_diverge_after() -> None:
    a = prompt_blocks(SYSTEM + "What is the capital of France?" * 20)
    b = prompt_blocks(SYSTEM + "Summarise this contract please." * 20)
    shared = len(SYSTEM.encode()) // BLOCK_BYTES
    assert a[:shared] == b[:shared]
    assert a[shared:] and b[shared:] and a[shared] != b[shared]


def test_blocks_are_chained_so_a_block_matches_only_after_the_same_prefix() -> None:
    block = "x" * BLOCK_BYTES
    assert prompt_blocks(block + block)[1] != prompt_blocks("y" * BLOCK_BYTES + block)[1]
    assert prompt_blocks("short") == ()  # no full block, no affinity


def test_hashing_is_bounded_for_huge_prompts() -> None:
    assert len(prompt_blocks("z" * (BLOCK_BYTES * MAX_PROMPT_BLOCKS * 10))) == MAX_PROMPT_BLOCKS
    ids = list(range(100_000))
    assert 0 < len(token_blocks(ids)) <= MAX_PROMPT_BLOCKS
    assert token_blocks(ids)[:4] == token_blocks(ids[:1000])[:4]
    assert token_blocks([2 ** 70]) == ()  # not token ids: no affinity, no error


def test_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex(capacity_blocks=100)
    blocks = prompt_blocks(SYSTEM * 3)
    index.record("r0", blocks[:5])
    assert index.matched_blocks("r0", blocks) == 5
    assert index.matched_blocks("r1", blocks) == 0
    # chained: the same text after a different first block is not the same prefix
    assert index.matched_blocks("r0", prompt_blocks("q" * BLOCK_BYTES + SYSTEM * 3)) == 0


def test_eviction_eats_prompts_from_the_end_so_the_head_stays_matchable() -> None:
    index = PrefixIndex(capacity_blocks=10)
    system = prompt_blocks(SYSTEM * 2)
    assert len(system) == 9
    index.record("r0", system)
    index.record("r0", prompt_blocks("another prompt " * 20))  # 1 block: the cache is full
    assert index.matched_blocks("r0", system) == 9
    index.record("r0", prompt_blocks("prompt 0 " * 60))  # 2 blocks: our last 2 go
    assert index.matched_blocks("r0", system) == 7
    for k in (1, 2):
        index.record("r0", prompt_blocks(f"prompt {k} " * 60))
    assert index.matched_blocks("r0", system) == 3
    assert index.matched_blocks("r0", system[:3]) == 3


def test_memory_is_bounded_per_replica_and_old_prefixes_are_evicted_first() -> None:
    index = PrefixIndex(capacity_blocks=64)
    first = prompt_blocks("first prompt " * 200)
    index.record("r0", first)
    for i in range(1000):
        index.record("r0", prompt_blocks(f"distinct prompt number {i} " * 40))
        assert index.size("r0") <= 64
    assert index.matched_blocks("r0", first) == 0
    recent = prompt_blocks("distinct prompt number 999 " * 40)
    assert index.matched_blocks("r0", recent) == len(recent)
    index.forget("r0")
    assert index.size("r0") == 0


def _model() -> tuple[ServedModel, list[Replica]]:
    replicas = [Replica(name=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm",
                        model="m", pool="default", max_model_len=8192) for i in range(2)]
    return ServedModel("m", [Pool("default", 100.0, replicas)], None, None, 256), replicas


def test_admission_carries_prefix_blocks_and_the_openai_user_as_session() -> None:
    model, replicas = _model()
    raw = b'{"model": "m", "prompt": "%s", "max_tokens": 8, "user": "alice"}' % SYSTEM.encode()
    cost = admit(model, openai.parse_completion(raw), replicas).cost
    assert cost.prefix_blocks == prompt_blocks(SYSTEM)
    assert cost.session == "alice"
    chat = (b'{"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": "%s"},'
            b' {"role": "user", "content": "hi"}]}' % SYSTEM.encode())
    cost = admit(model, openai.parse_chat(chat), replicas).cost
    assert cost.prefix_blocks[:4] == prompt_blocks(SYSTEM)[:4] and cost.session is None


def test_absurd_session_ids_are_ignored() -> None:
    model, replicas = _model()
    for user in (b'"' + b"u" * 300 + b'"', b'""', b"42"):
        raw = b'{"model": "m", "prompt": "hi", "max_tokens": 8, "user": %s}' % user
        assert admit(model, openai.parse_completion(raw), replicas).cost.session is None
