"""What was offered lately: arrivals per model, and what completed requests generated and
took per pool and role, summed in one-second buckets over a sliding window (memory does not
grow with the request rate)."""

from __future__ import annotations

from collections import deque
from typing import Hashable


class WindowSums:
    """Sums of a few quantities over the last ``window`` seconds, in one-second buckets."""

    def __init__(self, window: float, width: int) -> None:
        self.window = window
        self.width = width
        self._buckets: deque[list[float]] = deque()  # [second, *sums]

    def add(self, now: float, *values: float) -> None:
        second = float(int(now))
        buckets = self._buckets
        if not buckets or buckets[-1][0] != second:
            buckets.append([second] + [0.0] * self.width)
        bucket = buckets[-1]
        for i, value in enumerate(values, 1):
            bucket[i] += value

    def sums(self, now: float) -> list[float]:
        buckets = self._buckets
        while buckets and buckets[0][0] <= now - self.window - 1:
            buckets.popleft()
        totals = [0.0] * self.width
        for bucket in buckets:
            if bucket[0] > now - self.window - 1:
                for i in range(self.width):
                    totals[i] += bucket[i + 1]
        return totals


class RecentDemand:
    """Arrivals by model (requests, prompt tokens), completions by pool group (requests,
    output tokens, seconds on the replica)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._arrivals: dict[str, WindowSums] = {}
        self._completions: dict[Hashable, WindowSums] = {}

    def arrived(self, model: str, prompt_tokens: int, now: float) -> None:
        sums = self._arrivals.get(model)
        if sums is None:
            sums = self._arrivals[model] = WindowSums(self.window, 2)
        sums.add(now, 1.0, float(prompt_tokens))

    def completed(self, group: Hashable, output_tokens: int, seconds: float, now: float) -> None:
        sums = self._completions.get(group)
        if sums is None:
            sums = self._completions[group] = WindowSums(self.window, 3)
        sums.add(now, 1.0, float(output_tokens), seconds)

    def arrivals(self, model: str, now: float) -> tuple[float, float]:
        """(requests per second, mean prompt tokens) of ``model``."""
        sums = self._arrivals.get(model)
        if sums is None:
            return 0.0, 0.0
        count, prompt = sums.sums(now)
        return count / self.window, prompt / count if count else 0.0

    def completions(self, group: Hashable, now: float) -> tuple[float, float]:
        """(mean output tokens, mean seconds on the replica) of ``group``'s completions."""
        sums = self._completions.get(group)
        if sums is None:
            return 0.0, 0.0
        count, output, seconds = sums.sums(now)
        return (output / count, seconds / count) if count else (0.0, 0.0)
