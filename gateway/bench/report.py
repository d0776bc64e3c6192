"""Figures from load-generator records: percentiles, throughput, errors (overall, per pool, per
replica), a markdown table, a live progress line, and optional PNG plots.

Definitions (all from the client's side):

- TTFT: from when a request was due (closed loop: sent) to its first token event; streams only.
- ITL: the gap between successive token-bearing reads of a stream, shared equally by the
  tokens of the later read (an engine or gateway that sends k tokens at once counts k gaps of
  gap/k); one sample per token after the first.
- e2e: from due to the last byte.
- output tokens/s and requests/s: successful requests' output tokens (usage when present)
  and count, over the wall time of the run (first request due -> last one done).
"""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import time
from typing import Any, Iterable, Sequence

from gateway.bench.loadgen import Record, Run


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default) of sorted values."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def distribution_ms(values: Iterable[float]) -> dict[str, float | int | None]:
    ordered = sorted(values)
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 3)
    return {"p50": ms(percentile(ordered, 50)), "p90": ms(percentile(ordered, 90)),
            "p99": ms(percentile(ordered, 99)),
            "mean": ms(sum(ordered) / len(ordered)) if ordered else None,
            "max": ms(ordered[-1]) if ordered else None, "samples": len(ordered)}


def inter_token_gaps(record: Record) -> list[float]:
    gaps: list[float] = []
    chunks = record.chunks
    for (t0, _), (t1, n) in zip(chunks, chunks[1:]):
        gaps += [(t1 - t0) / n] * n
    return gaps


def summarize_records(records: Sequence[Record], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors = collections.Counter(r.error for r in records if not r.ok)
    output = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    streamed = [r for r in ok if r.chunks]
    out: dict[str, Any] = {
        "requests": len(records), "ok": len(ok), "errors": dict(sorted(errors.items())),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_tokens": output,
        "output_tokens_per_s": round(output / wall, 1) if wall > 0 else None,
        "prompt_tokens": sum(prompts) if len(prompts) == len(ok) and ok else None,
        "e2e_ms": distribution_ms(r.e2e for r in ok),
    }
    if streamed:
        out["ttft_ms"] = distribution_ms(r.ttft for r in streamed)  # type: ignore[misc]
        out["itl_ms"] = distribution_ms(g for r in streamed for g in inter_token_gaps(r))
    return out


def summarize(run: Run) -> dict[str, Any]:
    """Overall, per pool and per replica (when the gateway named them in its headers)."""
    wall = run_wall(run.records, run)
    out: dict[str, Any] = {"overall": summarize_records(run.records, wall)}
    for key in ("pool", "replica"):
        groups: dict[str, list[Record]] = collections.defaultdict(list)
        for r in run.records:
            name = getattr(r, key)
            if name is not None:
                groups[name].append(r)
        if groups:
            out[f"by_{key}"] = {name: summarize_records(rs, wall)
                                for name, rs in sorted(groups.items())}
    return out


def run_wall(records: Sequence[Record], run: Run) -> float:
    if not records:
        return run.wall
    return max(r.end for r in records) - min(r.due for r in records)


# ---------------------------------------------------------------------------------------------
# Tables

def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


COLUMNS = ("| {label} | requests | errors | req/s | output tok/s | TTFT p50 / p90 / p99 ms "
           "| ITL p50 / p99 ms | e2e p50 / p99 ms |")


def table_row(label: str, s: dict[str, Any]) -> str:
    ttft, itl, e2e = s.get("ttft_ms") or {}, s.get("itl_ms") or {}, s["e2e_ms"]
    errors = sum(s["errors"].values())
    kinds = ", ".join(f"{k} {v}" for k, v in s["errors"].items())
    return (f"| {label} | {s['requests']} | {errors}{f' ({kinds})' if kinds else ''} "
            f"| {_f(s['requests_per_s'])} | {_f(s['output_tokens_per_s'], 0)} "
            f"| {_f(ttft.get('p50'))} / {_f(ttft.get('p90'))} / {_f(ttft.get('p99'))} "
            f"| {_f(itl.get('p50'), 2)} / {_f(itl.get('p99'), 2)} "
            f"| {_f(e2e.get('p50'))} / {_f(e2e.get('p99'))} |")


def table(levels: Sequence[tuple[str, dict[str, Any]]], label: str = "load") -> str:
    """Markdown: one row per load level, then per level a table of its pools and one of its
    replicas (when there are several)."""
    header = COLUMNS.format(label=label)
    rule = "|---" + "|---:" * (header.count("|") - 2) + "|"
    lines = [header, rule] + [table_row(name, s["overall"]) for name, s in levels]
    for name, s in levels:
        for key in ("by_pool", "by_replica"):
            if len(s.get(key, ())) > 1:  # one pool or replica: the overall row says it all
                lines += ["", f"{label} {name}, {key[3:]}:", "",
                          COLUMNS.format(label=key[3:]), rule]
                lines += [table_row(k, v) for k, v in s[key].items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Live progress

class Progress:
    """A one-line status on stderr, rewritten twice a second; feed it records as they finish."""

    def __init__(self, label: str, total: int | None = None, duration: float | None = None,
                 stream: Any = None) -> None:
        self.label, self.total, self.duration = label, total, duration
        self.stream = stream or sys.stderr
        self.done = self.errors = self.tokens = 0
        self.started = time.perf_counter()

    def __call__(self, record: Record) -> None:
        self.done += 1
        self.errors += not record.ok
        self.tokens += record.output_tokens

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        of = f"/{self.total}" if self.total else ""
        until = f"/{self.duration:g}" if self.duration else ""
        rate = self.done / elapsed if elapsed > 0 else 0.0
        tps = self.tokens / elapsed if elapsed > 0 else 0.0
        return (f"{self.label}: {elapsed:5.1f}{until} s  {self.done}{of} done  "
                f"{self.errors} errors  {rate:,.1f} req/s  {tps:,.0f} tok/s")

    async def show(self, every: float = 0.5) -> None:
        """Run as a task; cancel it when the run ends (it then prints the final line)."""
        try:
            while True:
                self.stream.write("\r\x1b[K" + self.line())
                self.stream.flush()
                await asyncio.sleep(every)
        except asyncio.CancelledError:
            self.stream.write("\r\x1b[K" + self.line() + "\n")
            self.stream.flush()
            raise


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib is optional: not a dependency of the product)

def plot(levels: Sequence[tuple[float, dict[str, Any]]], path: str, xlabel: str) -> str:
    """TTFT (p50, p99) and throughput vs load; returns a message saying what was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib); skipped {path}"
    xs = [x for x, _ in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for q in ("p50", "p99"):
        key = "ttft_ms" if any("ttft_ms" in s["overall"] for _, s in levels) else "e2e_ms"
        ys = [(s["overall"].get(key) or {}).get(q) for _, s in levels]
        left.plot(xs, [math.nan if y is None else y for y in ys], marker="o",
                  label=f"{key[:-3].upper()} {q}")
    left.set(xlabel=xlabel, ylabel="ms", title="latency")
    left.legend()
    left.grid(alpha=0.3)
    right.plot(xs, [s["overall"]["output_tokens_per_s"] or 0 for _, s in levels], marker="o",
               label="output tokens/s")
    right.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput")
    twin = right.twinx()
    twin.plot(xs, [s["overall"]["requests_per_s"] or 0 for _, s in levels], marker="s",
              color="tab:orange", label="requests/s")
    twin.set_ylabel("requests/s")
    right.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"
