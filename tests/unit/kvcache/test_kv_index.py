"""The exact index: engine hashes mapped to the gateway's keys over token ids, removals,
clears, bounds, the blocks just sent, and when events count as stopped."""

from __future__ import annotations

from gateway.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from gateway.kvcache.index import PromptKeys, ReplicaBlocks

SIZE = 4


def stored(hashes, parent, tokens, lora=None, extra=None, medium="GPU"):
    return BlockStored(tuple(hashes), parent, tuple(tokens), SIZE, lora, extra, medium)


def batch(*events):
    return EventBatch(0.0, tuple(events))


def index(**kw) -> ReplicaBlocks:
    blocks = ReplicaBlocks(clock=lambda: 0.0, **kw)
    blocks.connected = True
    return blocks


PROMPT = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens more


def test_the_engines_hashes_are_its_own_business_token_ids_key_the_blocks():
    blocks = index()
    # Any engine hashes (ints or bytes, seeded however): the keys come from the tokens.
    blocks.apply(batch(stored([b"\x01" * 32, 77], None, PROMPT[:8])))
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 2
    blocks.apply(batch(stored([-5], 77, PROMPT[8:12])))  # a child announced later
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 3
    assert blocks.matched(PromptKeys([1] + PROMPT[1:]), 0.0) == 0  # first token differs
    assert blocks.matched(PromptKeys(PROMPT[:4] + [0] + PROMPT[5:]), 0.0) == 1


def test_a_removed_block_ends_the_run_and_a_clear_empties_it():
    blocks = index()
    blocks.apply(batch(stored([1, 2, 3], None, PROMPT[:12])))
    blocks.apply(batch(BlockRemoved((3,), "GPU")))
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 2
    blocks.apply(batch(BlockRemoved((1,), "GPU")))
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 0  # the head is gone: nothing leads
    blocks.apply(batch(BlockRemoved((999,), "GPU")))  # stored before we listened: ignored
    blocks.apply(batch(AllBlocksCleared()))
    assert blocks.size() == 0


def test_a_block_held_in_another_tier_stays_held_until_every_tier_lets_go():
    blocks = index()
    blocks.apply(batch(stored([1], None, PROMPT[:4], medium="GPU"),
                       stored([1], None, PROMPT[:4], medium="CPU")))
    blocks.apply(batch(BlockRemoved((1,), "GPU")))
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 1
    blocks.apply(batch(BlockRemoved((1,), "CPU")))
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 0


def test_an_adapter_or_a_cache_salt_makes_other_blocks():
    blocks = index()
    blocks.apply(batch(stored([1, 2], None, PROMPT[:8], lora="sql")))
    assert blocks.matched(PromptKeys(PROMPT), 0.0) == 0
    assert blocks.matched(PromptKeys(PROMPT, lora="sql"), 0.0) == 2
    assert blocks.matched(PromptKeys(PROMPT, lora="other"), 0.0) == 0
    # vLLM's extra keys: the salt on the first block only, the adapter on every block.
    blocks.apply(batch(stored([5, 6], None, PROMPT[:8], extra=(("s1",), None))))
    assert blocks.matched(PromptKeys(PROMPT, salt="s1"), 0.0) == 2
    assert blocks.matched(PromptKeys(PROMPT, salt="s2"), 0.0) == 0
    blocks.apply(batch(stored([7, 8], None, PROMPT[:8], lora="a", extra=(("a", "s"), ("a",)))))
    assert blocks.matched(PromptKeys(PROMPT, lora="a", salt="s"), 0.0) == 2


def test_a_block_whose_parent_is_unknown_cannot_be_keyed_and_is_counted():
    blocks = index()
    blocks.apply(batch(stored([9], 8, PROMPT[4:8])))
    assert blocks.size() == 0 and blocks.orphans == 1


def test_memory_is_bounded_by_the_engines_block_count():
    blocks = index(capacity=3)
    for n in range(10):
        blocks.apply(batch(stored([n], None, [n] * SIZE)))
    assert blocks.size() == 3 and blocks.overflowed == 7
    assert blocks.matched(PromptKeys([9] * SIZE), 0.0) == 1
    assert blocks.matched(PromptKeys([0] * SIZE), 0.0) == 0


def test_blocks_just_sent_count_as_held_for_a_while():
    blocks = index(pending_seconds=2.0)
    blocks.apply(batch(stored([1], None, PROMPT[:4])))
    prompt = PromptKeys(PROMPT)
    assert blocks.matched(prompt, 10.0) == 1
    blocks.note_sent(prompt, 1, 10.0)
    assert blocks.matched(PromptKeys(PROMPT), 11.0) == 3
    assert blocks.matched(PromptKeys(PROMPT), 12.5) == 1
    assert blocks.predicted_tokens == SIZE and blocks.queried_tokens == len(PROMPT)


def test_events_count_as_stopped_when_sent_blocks_go_unannounced():
    blocks = index(stale_after=5.0)
    assert not blocks.live(0.0)  # no block size known yet: nothing to key prompts by
    blocks.apply(batch(stored([1], None, PROMPT[:4])))
    assert blocks.live(0.0)
    blocks.note_sent(PromptKeys(PROMPT[:4]), 1, 1.0)  # all held: no event is owed
    assert blocks.live(100.0)
    blocks.note_sent(PromptKeys(PROMPT), 1, 100.0)  # two new blocks: an event is owed
    assert blocks.live(104.0) and not blocks.live(106.0)
    blocks.apply(batch(stored([2], 1, PROMPT[4:8])))
    assert blocks.live(106.0)
    blocks.connected = False
    assert not blocks.live(106.0)


def test_churn_is_what_was_stored_lately_over_the_engines_blocks():
    now = [0.0]
    blocks = ReplicaBlocks(capacity=8, clock=lambda: now[0])
    blocks.connected = True
    assert blocks.churn(0.0) == 0.0
    blocks.apply(batch(stored([1, 2], None, PROMPT[:8])))
    assert blocks.churn(0.0) == 2 / 8
    blocks.apply(batch(stored([1], None, PROMPT[:4])))  # held already: nothing new
    assert blocks.churn(0.0) == 2 / 8
    now[0] = 10.0  # one half-life on
    assert blocks.churn(10.0) == 1 / 8
    blocks.note_sent(PromptKeys(PROMPT), 2, 10.0)  # a third block is on its way
    assert blocks.churn(10.0) == 2 / 8
