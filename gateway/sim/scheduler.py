"""The pure timing model of one simulated GPU: continuous batching, no asyncio, no clock.

``BatchScheduler``: each ``step(now)`` admits waiting sequences while running slots and KV
capacity allow, spends a per-step token budget on decodes (one token per decoding sequence)
and chunked prefill, and returns how long the step takes:

    step = step_base + decode_per_seq * decoding sequences + prefill_per_token * prefill tokens

KV held by a sequence = its prompt + generated tokens (+1 for the token being written); when a
decode step would overflow the cache the newest sequence is preempted and later recomputed,
as vLLM does. With a prefix cache, full prompt blocks seen before skip their prefill.
``gateway.sim.vllm_v1`` is the other model, vLLM V1's scheduler as written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

from gateway.kvcache.events import KvEvent
from gateway.kvcache.index import extra_keys
from gateway.sim.metrics import Meter
from gateway.sim.profiles import Profile

if TYPE_CHECKING:  # only the HTTP side's waiter; the model itself never awaits
    import asyncio


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine."""

    prompt_tokens: int
    max_new_tokens: int            # exactly this many tokens will be generated
    finish_reason: str = "length"  # "length" or "stop", reported when it completes
    block_hashes: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()  # what KV events announce (``vllm_v1``, with kv_events)
    lora_name: str | None = None      # the LoRA adapter it runs under (keys its blocks)
    cache_salt: str | None = None     # vLLM's ``cache_salt`` (keys its first block)
    # Disaggregated decode: prompt tokens whose KV another engine computed and this one has
    # loaded before the request was added; admitted as computed (once: a preempted request
    # recomputes what its own cache lost, as vLLM does).
    external_tokens: int = 0
    arrived: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prefill_target: int = 0        # context tokens to (re)compute before the next token
    computed: int = 0
    generated: int = 0             # scheduler's count
    visible: int = 0               # count delivered to the HTTP side
    held: int = 0                  # KV tokens held
    cached: int = 0
    finished: bool = False         # scheduler is done with it
    done: bool = False             # the HTTP side may finish (delivered or aborted)
    aborted: bool = False
    waiter: asyncio.Future | None = None


def block_hashes(ids: Seq[int], block_size: int, lora: str | None = None,
                 salt: str | None = None) -> tuple[int, ...]:
    """Chained hashes of the full blocks of a prompt: equal hash = equal whole prefix. As in
    vLLM, a LoRA adapter keys every block and a ``cache_salt`` the first one, so neither
    shares blocks with a request that lacks it."""
    out, parent = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        extra = extra_keys(lora, salt, start == 0)
        block = tuple(ids[start:start + block_size])
        parent = hash((parent, block) if extra is None else (parent, block, extra))
        out.append(parent)
    return tuple(out)


class PrefixCache:
    """Block hashes of recently computed prompts, LRU, bounded by the KV capacity."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: tuple[int, ...]) -> int:
        """Tokens of the longest cached prefix (touching its blocks)."""
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            hit += 1
        return hit * self.block_size

    def insert(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)


class BatchScheduler:
    """Continuous batching on one GPU, as a pure function of calls to ``step``."""

    def __init__(self, profile: Profile, meter: Meter, prefix_cache: bool = False) -> None:
        self.p = profile
        self.meter = meter
        self.cache = PrefixCache(profile.kv_capacity_tokens, profile.block_size) if prefix_cache else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_used = 0
        self.completed = 0
        self.aborted = 0

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def take_kv_events(self) -> list[KvEvent]:
        """KV cache events since the last call: only vLLM V1's model makes them."""
        return []

    def add(self, seq: Sequence, now: float) -> None:
        seq.arrived = now
        self.waiting.append(seq)

    def abort(self, seq: Sequence, now: float) -> None:
        """Free the slot and KV of a sequence at once (client went away)."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finished = seq.done = seq.aborted = True
        self.aborted += 1
        self._record_done(seq, "abort", now)

    def step(self, now: float, slowdown: float = 1.0) -> tuple[float, list[Sequence]]:
        """Run one engine step starting at ``now``; return its duration and who got a token."""
        p = self.p
        decoders = self._make_room_for_decodes()
        self.kv_used += len(decoders)
        for s in decoders:
            s.held += 1
        budget = p.max_batched_tokens - len(decoders)
        emitting = list(decoders)
        prefill = 0
        for s in self.running:  # continue chunked prefills, oldest first
            if s.computed < s.prefill_target and budget > 0:
                chunk = min(budget, s.prefill_target - s.computed)
                s.computed += chunk
                budget -= chunk
                prefill += chunk
                if s.computed == s.prefill_target:
                    emitting.append(s)
        while self.waiting and budget > 0 and len(self.running) < p.max_running_seqs:
            s = self.waiting[0]
            need = s.prompt_tokens + s.generated + 1
            if self.kv_used + need > p.kv_capacity_tokens:
                break  # FCFS: the head of the queue waits for KV, and so does everyone behind it
            self.waiting.popleft()
            self.running.append(s)
            self.kv_used += need
            s.held, s.prefill_target, s.computed = need, need - 1, 0
            if s.admitted_at is None:
                s.admitted_at = now
                if self.cache is not None:
                    s.cached = min(self.cache.match(s.block_hashes), s.prompt_tokens - 1)
                    s.computed = s.cached
                    self.meter.prefix_queries += s.prompt_tokens
                    self.meter.prefix_hits += s.cached
                s.computed = max(s.computed, min(s.external_tokens, s.prompt_tokens - 1))
                s.external_tokens = 0
            chunk = min(budget, s.prefill_target - s.computed)
            s.computed += chunk
            budget -= chunk
            prefill += chunk
            if s.computed == s.prefill_target:
                emitting.append(s)
        if not emitting and not prefill:
            return 0.0, []
        duration = (p.step_base_s + p.decode_per_seq_s * len(decoders)
                    + p.prefill_per_token_s * prefill) * slowdown
        end = now + duration
        self.meter.steps += 1
        self.meter.busy_slots += len(self.running)
        self.meter.prefill_tokens += prefill
        for s in emitting:
            self._emit(s, end)
        return duration, emitting

    def _make_room_for_decodes(self) -> list[Sequence]:
        """Decoding sequences of this step, after preempting the newest ones if KV is full."""
        while True:
            decoders = [s for s in self.running if s.computed >= s.prefill_target]
            if self.kv_used + len(decoders) <= self.p.kv_capacity_tokens or len(self.running) <= 1:
                return decoders
            victim = self.running.pop()  # newest first, recomputed later (vLLM's recompute preemption)
            self.kv_used -= victim.held
            victim.held = victim.computed = 0
            self.waiting.appendleft(victim)
            self.meter.preemptions += 1

    def _emit(self, s: Sequence, at: float) -> None:
        s.generated += 1
        if s.first_token_at is None:
            s.first_token_at = at
            self.meter.first_token(at - s.arrived)
            self._prefilled(s)
        else:
            self.meter.itl.observe(at - s.last_token_at)
        s.last_token_at = at
        if s.generated >= s.max_new_tokens:
            s.finished = True
            self.running.remove(s)
            self._release(s)
            self.completed += 1
            self._record_done(s, s.finish_reason, at)

    def _prefilled(self, s: Sequence) -> None:
        """Its prompt is computed: the prefix cache learns its blocks."""
        if self.cache is not None:
            self.cache.insert(s.block_hashes)

    def _release(self, s: Sequence) -> None:
        """The sequence is done or gone: free the KV it holds."""
        self.kv_used -= s.held
        s.held = 0

    def _record_done(self, s: Sequence, reason: str, at: float) -> None:
        admitted = s.admitted_at if s.admitted_at is not None else at
        first = s.first_token_at if s.first_token_at is not None else at
        self.meter.request_done(reason, s.prompt_tokens, s.generated, at - s.arrived,
                                admitted - s.arrived, first - admitted)
