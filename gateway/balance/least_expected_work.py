"""The default policy: send each request where it will wait behind the least work.

Every candidate replica gets a score, in output-token equivalents (lowest wins, ties at
random):

    score = output tokens still to generate there         (the ledger: live, per token)
          + request_tokens * requests in flight there    (the ledger)
          + prefill_weight * prompt tokens still to prefill there (the ledger, this one's too)
          - prefix_weight * this prompt's tokens cached there
          + signals_weight * (engine work the ledger does not explain + KV pressure)
          - session_tokens                          (only the session's last replica)

- **Live remaining work.** The ledger keeps, per replica, the prompt tokens not yet
  prefilled (released at each request's first token) and the output tokens still expected
  (released as they stream back). ``prefill_weight`` prices a prompt token in output tokens:
  1 by default, because on the calibrated profile the measured optimum sits there (a prompt
  token costs the GPU several times less time, but it is owed up front, before any first
  token, while decode work is spread over the whole batch's life; see docs/performance.md "Scheduling").
- **Requests as well as tokens.** A batched engine's step time grows with the sequences it
  runs, not with the tokens each has left, so each request in flight adds
  ``request_tokens`` (1,024: measured on two timing models, docs/performance.md "Scheduling").
- **Prefix affinity.** Where a replica's engine publishes its KV-cache events and they are
  live (``gateway/kvcache``), what it holds is known exactly: the leading blocks of this
  prompt its engine announced (or was sent in the last ``pending_seconds``). Elsewhere
  ``PrefixIndex`` guesses: it remembers which prompt blocks each replica was sent
  (bounded LRU per replica, recorded at selection). A replica that holds this prompt's prefix
  scores lower by ``prefix_weight`` output tokens per cached prompt token: the prefill it
  skips, plus what keeping a prefix on one replica is worth beyond that (the hit does not
  stall that replica's running batch, and the prefix does not evict other prompts from a
  second replica's cache). It is a bounded bonus: once that replica owes more than the bonus,
  another one wins (and learns the prefix), so a popular prefix spreads instead of starving
  the others.
- **Engine signals** (``fleet/engine_signals.py``), only while fresh
  (``signals_max_age`` scrape intervals): requests the engine holds beyond the ledger's
  in-flight count at the same moment (work other clients sent it directly) count as that
  many typical requests; a KV cache fuller than ``kv_pressure_from`` adds up to the
  replica's whole outstanding work again (new sequences would queue for KV). A scrape never
  lowers what the ledger says.
- **Session stickiness.** The replica that served a session last gets a bonus of
  ``session_tokens``: a soft preference that yields as soon as it is that much busier.

With ``prefill_weight 1`` and every other weight 0 (``request_tokens`` too) this is exactly
least_outstanding_tokens.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Callable, Sequence

from gateway.balance.ledger import LoadLedger
from gateway.balance.policy import Policy, RequestCost, pick_lowest
from gateway.balance.prefix_index import TOKENS_PER_BLOCK, PrefixIndex
from gateway.config import SchedulingConfig
from gateway.fleet.engine_signals import EngineSignals
from gateway.fleet.replica import Replica

MAX_SESSIONS = 65536  # sessions remembered (LRU); beyond it the oldest lose their preference


class LeastExpectedWork(Policy):
    takes_scheduling = True

    def __init__(self, rng: random.Random | None = None,
                 scheduling: SchedulingConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rng = rng or random.Random()
        self.weights = scheduling or SchedulingConfig()
        self.clock = clock
        self.prefixes = PrefixIndex(self.weights.prefix_cache_tokens // TOKENS_PER_BLOCK)
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session -> replica name
        self.typical_request_tokens = 512.0  # moving average of request cost (prompt + output)

    def select(self, replicas: Sequence[Replica], cost: RequestCost,
               ledger: LoadLedger) -> Replica:
        w = self.weights
        request_tokens = cost.prompt_tokens + cost.output_tokens
        self.typical_request_tokens += 0.05 * (request_tokens - self.typical_request_tokens)
        blocks = cost.prefix_blocks if w.prefix_weight > 0 else ()
        # Hashed blocks cover the prompt up to its last partial block.
        tokens_per_block = cost.prompt_tokens / (len(blocks) + 0.5) if blocks else 0.0
        prompt = cost.prompt_keys if w.prefix_weight > 0 else None
        # An engine's blocks are exact tokens; the prompt's cost may be an estimate (the
        # weights were tuned on it): a cached share of the prompt is that share of its cost.
        per_token = cost.prompt_tokens / len(prompt) if prompt else 0.0
        exact: dict[str, int] = {}  # replica -> blocks its engine holds (live events only)
        sticky = self.sessions.get(cost.session) if cost.session and w.session_tokens else None
        now = self.clock()

        def prefix_credit(replica: Replica) -> float:
            """Output-token equivalents the prompt's cached prefix saves there, less (with
            ``churn_weight``) what caching the rest costs a cache that turns over fast."""
            held = replica.kv_cache
            if prompt is not None and held is not None and held.live(now):
                exact[replica.name] = matched = held.matched(prompt, now)
                cached = min(matched * held.block_size * per_token,  # type: ignore[operator]
                             cost.prompt_tokens)
                credit = w.prefix_weight * cached
                if w.churn_weight:
                    credit -= (w.churn_weight * (cost.prompt_tokens - cached)
                               * min(1.0, held.churn(now)))
                return credit
            if blocks:
                cached = self.prefixes.matched_blocks(replica.name, blocks) * tokens_per_block
                return w.prefix_weight * min(cached, cost.prompt_tokens)
            return 0.0

        def score(replica: Replica) -> float:
            load = ledger.load(replica.name)
            outstanding = load.outstanding_tokens
            total = (outstanding - load.prefill_tokens + w.request_tokens * load.in_flight
                     + w.prefill_weight * (load.prefill_tokens + cost.prompt_tokens))
            if blocks or prompt is not None:
                total -= prefix_credit(replica)
            if w.signals_weight and replica.signals is not None:
                total += w.signals_weight * self._engine_work(replica.signals, outstanding, now)
            if replica.name == sticky:
                total -= w.session_tokens
            return total

        chosen = pick_lowest(replicas, score, self.rng)
        if blocks:  # kept warm for when events stop
            self.prefixes.record(chosen.name, blocks)
        if prompt is not None and chosen.kv_cache is not None and chosen.name in exact:
            chosen.kv_cache.note_sent(prompt, exact[chosen.name], now)
        if cost.session and w.session_tokens:
            self.sessions[cost.session] = chosen.name
            self.sessions.move_to_end(cost.session)
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return chosen

    def forget(self, replica: str) -> None:
        """The replica left the fleet: drop what was remembered about it."""
        self.prefixes.forget(replica)
        for session in [s for s, name in self.sessions.items() if name == replica]:
            del self.sessions[session]

    def _engine_work(self, signals: EngineSignals, outstanding: int, now: float) -> float:
        """Work a fresh scrape shows beyond the ledger's: unexplained requests, KV pressure."""
        w = self.weights
        if not signals.fresh(now, w.signals_max_age * w.signals_interval):
            return 0.0
        unexplained = signals.unexplained_requests() * (self.typical_request_tokens
                                                         + w.request_tokens)
        pressure = 0.0
        if signals.kv_usage is not None and signals.kv_usage > w.kv_pressure_from:
            fullness = (signals.kv_usage - w.kv_pressure_from) / (1 - w.kv_pressure_from)
            pressure = fullness * (outstanding + unexplained)
        return unexplained + pressure
