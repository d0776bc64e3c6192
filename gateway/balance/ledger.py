"""The load ledger: outstanding tokens and in-flight requests per replica.

A replica's outstanding tokens are the work it still owes: for each in-flight request,
the prompt tokens not yet prefilled plus the output tokens still expected; the first part is
also kept on its own (``prefill_tokens``), so a policy can weigh the two kinds of work. Only
prompts whose first token the gateway will see count there (streams): a non-streamed
request's prompt stays in its outstanding tokens until it ends, but is not said to be waiting
for its prefill all that time.
Every change goes through a ``Lease`` (one per request), which releases each token it
reserved exactly once, so totals can never drift or go negative, whatever path a request
ends on.

``LoadLedger`` is the interface policies read; ``InProcessLedger`` serves one gateway
process. A shared (Redis-backed) ledger implements the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class ReplicaLoad:
    outstanding_tokens: int = 0
    in_flight: int = 0
    prefill_tokens: int = 0  # the part of outstanding_tokens that is prompts not yet prefilled

    def add(self, tokens: int, requests: int, prefill: int) -> None:
        self.outstanding_tokens += tokens
        self.in_flight += requests
        self.prefill_tokens += prefill

    def copy(self) -> "ReplicaLoad":
        return ReplicaLoad(self.outstanding_tokens, self.in_flight, self.prefill_tokens)


class LoadLedger(ABC):
    @abstractmethod
    def load(self, replica: str) -> ReplicaLoad:
        """Current load of one replica (a view; do not mutate)."""

    def own_load(self, replica: str) -> ReplicaLoad:
        """The part of ``load`` this process itself put there (exact; what per-worker
        metrics sum). Equal to ``load`` unless the ledger is shared."""
        return self.load(replica)

    @abstractmethod
    def _adjust(self, replica: str, tokens: int, requests: int, prefill: int = 0) -> None:
        """Apply a delta (``prefill``: the part of ``tokens`` that is unprefilled prompt).
        Only leases call this."""

    def lease(self, replica: str, prompt_tokens: int, output_tokens: int,
              asked: int | None = None, streamed: bool = True) -> "Lease":
        """Reserve a request's cost on ``replica`` at dispatch: its prompt and the output
        expected (``asked``, when larger: what the client allows it to generate).
        ``streamed``: its first token will be seen (its prompt counts as ``prefill_tokens``
        until then)."""
        output_tokens = max(output_tokens, 0)
        lease = Lease(self, replica, max(prompt_tokens, 0), output_tokens, streamed)
        if asked is not None and asked > output_tokens > 0:
            lease.renew, lease.unreserved = output_tokens, asked - output_tokens
        return lease

    def snapshot(self) -> dict[str, ReplicaLoad]:
        return {}


class InProcessLedger(LoadLedger):
    """Per-process totals in a dict; exact for everything this process sent."""

    def __init__(self) -> None:
        self._loads: defaultdict[str, ReplicaLoad] = defaultdict(ReplicaLoad)

    def load(self, replica: str) -> ReplicaLoad:
        return self._loads[replica]

    def _adjust(self, replica: str, tokens: int, requests: int, prefill: int = 0) -> None:
        load = self._loads[replica]  # inline: called per streamed read
        load.outstanding_tokens += tokens
        load.in_flight += requests
        load.prefill_tokens += prefill

    def snapshot(self) -> dict[str, ReplicaLoad]:
        return {name: load.copy() for name, load in self._loads.items()}


class Lease:
    """One request's reservation on one replica, released piece by piece, exactly once."""

    __slots__ = ("ledger", "replica", "prompt_tokens", "output_tokens", "closed", "on_close",
                 "renew", "unreserved", "streamed")

    def __init__(self, ledger: LoadLedger, replica: str, prompt_tokens: int,
                 output_tokens: int, streamed: bool = True) -> None:
        self.ledger, self.replica, self.streamed = ledger, replica, streamed
        self.prompt_tokens, self.output_tokens = prompt_tokens, output_tokens
        self.closed = False
        # An expectation below the ask: a request still generating when its reservation is
        # used up is expected to go on as long again (``renew``), within the ``unreserved``
        # rest of its ask, instead of weighing nothing.
        self.renew = self.unreserved = 0
        self.on_close: Callable[[], None] | None = None  # e.g. wake a request queued for a slot
        ledger._adjust(replica, prompt_tokens + output_tokens, 1,
                       prompt_tokens if streamed else 0)

    @property
    def remaining(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def first_token(self) -> None:
        """The prompt is prefilled: its part of the reservation is done."""
        if self.prompt_tokens and not self.closed:
            self.ledger._adjust(self.replica, -self.prompt_tokens, 0,
                                -self.prompt_tokens if self.streamed else 0)
            self.prompt_tokens = 0

    def generated(self, tokens: int) -> None:
        """``tokens`` more output tokens arrived (never releases more than was reserved)."""
        if self.closed:
            return
        done = tokens if tokens < self.output_tokens else self.output_tokens  # per read: no min()
        if done > 0:
            self.ledger._adjust(self.replica, -done, 0)
            self.output_tokens -= done
        if not self.output_tokens and self.renew:
            self.unreserved -= tokens - done  # generated past the reservation: out of the ask
            more = min(self.renew, self.unreserved)
            if more > 0:
                self.unreserved -= more
                self.output_tokens = more
                self.ledger._adjust(self.replica, more, 0)
            else:
                self.renew = 0

    def close(self) -> None:
        """Release whatever is left: completion, error, timeout or disconnect alike."""
        if not self.closed:
            self.closed = True
            self.ledger._adjust(self.replica, -(self.prompt_tokens + self.output_tokens), -1,
                                -self.prompt_tokens if self.streamed else 0)
            self.prompt_tokens = self.output_tokens = 0
            if self.on_close is not None:
                self.on_close()
