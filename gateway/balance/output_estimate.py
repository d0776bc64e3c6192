"""How many output tokens a request will really generate, learned from what the fleet sent.

Clients set ``max_tokens`` far above what they use, and differently from each other (one
asks 256, another 4,096 for the same kind of answer). Reserving what they ask makes the
ledger's outstanding work mostly noise; reserving what requests of the same kind actually
generated makes it work. Measured in virtual time (docs/performance.md "Scheduling": requests asking 256,
1,024 or 4,096 at random), reserving the asks raised TTFT p99 by 20-100% over knowing each
true length; the learned expectation came within 7% of knowing it.

Per model and ``max_tokens`` band (powers of two), a moving average of the share of the ask
that completed requests used. A band with fewer than ``MIN_SEEN`` completions expects the
whole ask (the old behaviour: safe before anything is known). Only the balancing uses the
expectation; the context window and the keys' token limits still count the whole ask.
"""

from __future__ import annotations

MIN_SEEN = 20     # completions in a band before its average is trusted
SMOOTHING = 0.05  # weight of each new completion in a band's average (~the last 20-40)


class OutputEstimate:
    def __init__(self) -> None:
        self._bands: dict[tuple[str, int], list[float]] = {}  # -> [share used, completions]

    def expect(self, model: str, asked: int) -> int:
        """Output tokens to reserve for a request that asks for ``asked`` (1..asked)."""
        band = self._bands.get((model, asked.bit_length()))
        if band is None or band[1] < MIN_SEEN:
            return asked
        return max(1, min(asked, round(band[0] * asked)))

    def observe(self, model: str, asked: int, generated: int) -> None:
        """A request that asked ``asked`` completed with ``generated`` output tokens."""
        if asked <= 0:
            return
        share = min(generated, asked) / asked
        key = (model, asked.bit_length())
        band = self._bands.get(key)
        if band is None:
            self._bands[key] = [share, 1]
            return
        band[1] += 1
        # A plain mean until the average is trusted, then a moving one (lengths drift).
        band[0] += (share - band[0]) * max(SMOOTHING, 1 / band[1])
