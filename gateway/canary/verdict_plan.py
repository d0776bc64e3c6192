"""The verdict's plan: which pools a verdict compares, and the verdict over a window of their
samples (scored by gateway/canary/verdict.py).

The baseline is, by default, the primary pool the config weighs heaviest (run-time weights,
as a rollout moves them, do not change it); the canary, by default, the first other pool
that is not the agreement reference. A shadow canary is also judged on its output agreement
with the pool it shadows, against the floors or, when the configured reference pool shadows
the same pool, as a drop against the reference's agreement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from gateway.canary.verdict import EXIT_CODES, verdict
from gateway.canary.samples import PairSample, Sample, SampleBook
from gateway.canary.config import CanaryJudgeConfig
from gateway.fleet.model import Pool, ServedModel


class CanaryError(ValueError):
    """The model has no such pools (a 404 / 400 at the admin API)."""


def _pool(model: ServedModel, name: str) -> Pool:
    return next(p for p in model.pools if p.name == name)


def default_baseline(model: ServedModel, exclude: str | None = None) -> str | None:
    primaries = [p for p in model.pools if p.shadow_of is None and p.name != exclude]
    if not primaries:
        return None
    return max(primaries, key=lambda p: p.configured_weight or 0.0).name


def choose_pools(model: ServedModel, baseline: str | None, canary: str | None,
                 reference: str | None = None) -> tuple[str, str]:
    names = [p.name for p in model.pools]
    for given in (baseline, canary):
        if given is not None and given not in names:
            raise CanaryError(f"model `{model.name}` has no pool `{given}` (its pools: "
                              f"{', '.join(names)})")
    if baseline is None:
        baseline = default_baseline(model, exclude=canary)
        if baseline is None:
            raise CanaryError(f"model `{model.name}` has no baseline pool besides `{canary}`")
    if canary is None:
        others = [n for n in names if n != baseline and n != reference]
        if not others:
            raise CanaryError(f"model `{model.name}` has a single pool: nothing to compare")
        canary = others[0]
    if canary == baseline:
        raise CanaryError("the baseline and the canary must be two different pools")
    return baseline, canary


def canaries(model: ServedModel, reference: str | None = None) -> list[tuple[str, str]]:
    """(baseline, canary) of every pool worth judging: each weighted pool against the
    default baseline, each shadow pool against the pool it shadows (the reference excluded:
    it measures the baseline's own noise)."""
    baseline = default_baseline(model)
    if baseline is None:
        return []
    return [(pool.shadow_of or baseline, pool.name) for pool in model.pools
            if pool.name not in (baseline, reference)]


@dataclass(frozen=True)
class Plan:
    """What one verdict reads: two pools' samples, and a shadow canary's pairs."""

    model: str
    baseline: str
    canary: str
    shadow: bool            # the canary is a shadow pool: its agreement is judged
    reference: str | None   # the agreement reference pool that applies, if any
    reference_note: str | None = None  # why a configured reference does not apply

    @property
    def pools(self) -> list[str]:
        return [p for p in (self.baseline, self.canary, self.reference) if p is not None]


def plan(model: ServedModel, config: CanaryJudgeConfig, baseline: str | None = None,
         canary: str | None = None, reference: str | None = None) -> Plan:
    """The pools to judge (CanaryError naming the problem when they do not exist)."""
    reference = reference or config.agreement.reference
    baseline, canary = choose_pools(model, baseline, canary, reference)
    target = _pool(model, canary)
    applies, note = None, None
    if target.shadow_of is not None and reference is not None and reference != canary:
        ref = next((p for p in model.pools if p.name == reference), None)
        if ref is None:
            note = f"reference pool `{reference}` is not a pool of `{model.name}`: floors used"
        elif ref.shadow_of != target.shadow_of:
            note = (f"reference pool `{reference}` does not shadow `{target.shadow_of}` as "
                    f"`{canary}` does: floors used")
        else:
            applies = reference
    return Plan(model.name, baseline, canary, target.shadow_of is not None, applies, note)


Records = dict[str, tuple[Sequence[Sample], Sequence[PairSample]]]  # pool -> its window


def judge_records(judged: Plan, records: Records, config: CanaryJudgeConfig,
                  window: float) -> dict[str, Any]:
    """The verdict over the window's records (pure: safe in a worker thread)."""
    base, _ = records.get(judged.baseline, ((), ()))
    can, pairs = records.get(judged.canary, ((), ()))
    ref_pairs = records.get(judged.reference, ((), ()))[1] if judged.reference else None
    result = verdict(base, can, config, pairs if judged.shadow else None, ref_pairs,
                     judged.reference)
    out = {"model": judged.model, "baseline": judged.baseline, "canary": judged.canary,
           "window_s": window, **result, "exit_code": EXIT_CODES[result["verdict"]]}
    if judged.shadow:
        out["agreement_reference"] = judged.reference
        if judged.reference_note:
            out["agreement_note"] = judged.reference_note
    return out


def since(window: float) -> float:
    return time.time() - window


def read_local(book: SampleBook, judged: Plan, start: float) -> Records:
    """This instance's records of the plan's pools since ``start``."""
    return {pool: (book.window(judged.model, pool, start),
                   book.pairs_window(judged.model, pool, start)) for pool in judged.pools}


def judge_model(book: SampleBook, model: ServedModel, config: CanaryJudgeConfig,
                baseline: str | None = None, canary: str | None = None,
                window: float | None = None, reference: str | None = None) -> dict[str, Any]:
    """The verdict over this instance's last ``window`` seconds (both pools, one period)."""
    judged = plan(model, config, baseline, canary, reference)
    window = window or config.window
    return judge_records(judged, read_local(book, judged, since(window)), config, window)
