"""Straggler scores and verdicts: a pure function of per-rank compute times (no torch, no ray).

Scores use each rank's own compute time, never its step time: a slow rank computes long while its
peers wait long in collectives and pipeline receives, so step times would blame the waiters.

Over a sliding window of the last `window` steps, a rank's value is the median of its compute times
(one slow step is noise, not a straggler). Two scores per rank:
- relative: its value / the median of its peers' values in the same pipeline stage (peers run the
  same layers on the same amount of data, so they should take the same time);
- individual: its value / its own baseline (the median of its `baseline_steps` steps before the
  window): catches a whole stage slowing down at once, where every peer is slow too. The baseline
  trails the window, so a slow drift of the whole job (data, numerics, a busy host) is absorbed
  rather than flagged.
A rank becomes a straggler after `consecutive` evaluations in a row above `ratio`, and stops being
one only after as many in a row below half the excess (1 + (ratio - 1) / 2): hysteresis, so a rank
whose score hovers near the bound is flagged once, not on and off.
Relative verdicts name one GPU worth replacing. Individual scores count only when every rank of a
stage is slower than its own history, none of them slower than its peers, while another stage is not
(a stage-wide slowdown; peers slowed along with one slow rank, e.g. sharing its host, are not): those
verdicts are reported, never acted on. One rank slower than its history but not than its peers, or
every stage slower at once, is the job or the host, not a device.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    ratio: float = 1.5
    """A score above this is slow (health.straggler_ratio)."""
    window: int = 5
    """Steps in the sliding window whose median is a rank's value."""
    consecutive: int = 4
    """Evaluations in a row above (or below) `ratio` to flag (or clear) a rank."""
    warmup_steps: int = 2
    """First steps of an attempt ignored (allocation, lazy init, restore)."""
    baseline_steps: int = 30
    """Steps before the window whose median is a rank's own baseline."""
    min_baseline_steps: int = 10
    """Fewer steps than this before the window: no individual score yet."""


@dataclass(frozen=True, kw_only=True)
class RankScore:
    rank: int
    """Global rank."""
    stage: int
    """Pipeline stage it belongs to."""
    relative: float
    """Its windowed compute / its stage peers' median."""
    individual: float | None
    """Its windowed compute / its own baseline (None until the baseline exists)."""
    straggler: bool
    """Flagged now."""


@dataclass(frozen=True, kw_only=True)
class StragglerVerdict:
    rank: int
    """The slow rank."""
    step: int
    """Step of the evaluation that flagged it."""
    score: float
    """The score that crossed the ratio."""
    basis: str
    """`relative` (slower than its stage peers: one bad GPU) or `individual` (slower than itself,
    its peers too: a whole stage or the whole job)."""
    compute_s: float
    """Its windowed compute time."""


@dataclass
class _Rank:
    window: deque = field(default_factory=deque)
    """The newest `window` compute times, oldest first."""
    baseline: deque = field(default_factory=deque)
    """The up to `baseline_steps` compute times before the window, oldest first."""
    ordered: list = field(default_factory=list)
    """`baseline`, sorted (its median in O(1); kept sorted as samples come and go)."""
    above: int = 0
    below: int = 0
    flagged: bool = False

    def add(self, value: float, window: int, baseline_steps: int) -> None:
        self.window.append(value)
        if len(self.window) > window:
            old = self.window.popleft()
            self.baseline.append(old)
            bisect.insort(self.ordered, old)
            if len(self.baseline) > baseline_steps:
                gone = self.baseline.popleft()
                del self.ordered[bisect.bisect_left(self.ordered, gone)]

    def recent(self) -> float:
        ordered = sorted(self.window)
        n = len(ordered)
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def usual(self, min_steps: int) -> float:
        """The median of the baseline (0.0 while it has fewer than `min_steps` samples)."""
        n = len(self.ordered)
        if n < min_steps or n == 0:
            return 0.0
        return self.ordered[n // 2] if n % 2 else (self.ordered[n // 2 - 1] + self.ordered[n // 2]) / 2


def _median_without(ordered: list[float], value: float) -> float:
    """The median of a sorted list with one occurrence of `value` left out (0.0 when nothing is left)."""
    n = len(ordered) - 1
    if n <= 0:
        return 0.0
    i = bisect.bisect_left(ordered, value)

    def at(k: int) -> float:  # the k-th of the list without index i
        return ordered[k] if k < i else ordered[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class StragglerTracker:
    """Folds (rank, step, compute_s) samples of one attempt into scores; `evaluate` returns the
    verdicts that became true at the newest step every rank has reported."""

    MAX_PENDING_STEPS = 256
    """Steps kept waiting for their last ranks' samples; older ones are dropped unevaluated."""

    def __init__(self, stage_of_rank: Mapping[int, int], config: StragglerConfig) -> None:
        """`stage_of_rank`: any read-only mapping (kept, not copied: a mesh's is computed, not stored)."""
        if not stage_of_rank:
            raise ValueError("a straggler tracker needs at least one rank")
        self.stage_of_rank = stage_of_rank
        self.config = config
        self._ranks: dict[int, _Rank] = {}
        """Per-rank state, made when a rank's first step is evaluated (an attempt may have 16k ranks)."""
        self._by_step: dict[int, dict[int, float]] = {}
        self._evaluated = 0
        self._first_step: int | None = None
        self.scores: dict[int, RankScore] = {}

    def add(self, rank: int, step: int, compute_s: float) -> None:
        if rank not in self.stage_of_rank or step <= self._evaluated:
            return
        if self._first_step is None or step < self._first_step:
            self._first_step = step
        self._by_step.setdefault(step, {})[rank] = compute_s
        if len(self._by_step) > self.MAX_PENDING_STEPS:  # a rank that never reports: forget the oldest
            del self._by_step[next(iter(self._by_step))]  # steps arrive in order: the first is the oldest

    def evaluate(self) -> list[StragglerVerdict]:
        """Consume every step all ranks have reported, in order; new verdicts."""
        verdicts: list[StragglerVerdict] = []
        for step in sorted(self._by_step):
            samples = self._by_step[step]
            if len(samples) < len(self.stage_of_rank):
                break
            del self._by_step[step]
            self._evaluated = step
            verdicts.extend(self._evaluate_step(step, samples))
        return verdicts

    def _evaluate_step(self, step: int, samples: dict[int, float]) -> list[StragglerVerdict]:
        c = self.config
        assert self._first_step is not None
        if step - self._first_step < c.warmup_steps:
            return []
        for rank, value in samples.items():
            state = self._ranks.get(rank)
            if state is None:
                state = self._ranks[rank] = _Rank()
            state.add(value, c.window, c.baseline_steps)
        if len(self._ranks) < len(self.stage_of_rank) or any(len(s.window) < c.window for s in self._ranks.values()):
            return []
        values = {r: s.recent() for r, s in self._ranks.items()}
        relative: dict[int, float] = {}
        individual: dict[int, float | None] = {}
        by_stage: dict[int, list[float]] = {}
        for rank, value in values.items():
            by_stage.setdefault(self.stage_of_rank[rank], []).append(value)
        for stage_values in by_stage.values():
            stage_values.sort()  # once per stage: each rank's peers' median is then O(log n), not O(n)
        for rank, value in values.items():
            stage_values = by_stage[self.stage_of_rank[rank]]
            typical = _median_without(stage_values, value)
            relative[rank] = value / typical if typical > 0 else 1.0
            baseline = self._ranks[rank].usual(c.min_baseline_steps)
            individual[rank] = value / baseline if baseline > 0 else None
        slow_stages = self._slow_stages(individual, relative)
        verdicts = []
        for rank, value in values.items():
            state = self._ranks[rank]
            stage = self.stage_of_rank[rank]
            worst, basis = relative[rank], "relative"
            if worst <= c.ratio and stage in slow_stages:
                worst, basis = individual[rank] or 1.0, "individual"
            state.above = state.above + 1 if worst > c.ratio else 0
            state.below = state.below + 1 if worst < 1 + (c.ratio - 1) / 2 else 0
            if not state.flagged and state.above >= c.consecutive:
                state.flagged = True
                verdicts.append(StragglerVerdict(rank=rank, step=step, score=worst, basis=basis, compute_s=value))
            elif state.flagged and state.below >= c.consecutive:
                state.flagged = False
            self.scores[rank] = RankScore(rank=rank, stage=stage, relative=relative[rank],
                                          individual=individual[rank], straggler=state.flagged)
        return verdicts

    def _slow_stages(self, individual: dict[int, float | None], relative: dict[int, float]) -> set[int]:
        """Stages whose every rank is slower than its own history, together (none slower than its
        peers), while some other stage is not: a stage-wide slowdown. A stage with a rank slower
        than its peers is that rank's doing (its peers may be slowed with it, sharing its host): the
        relative score names it. When every stage slowed, it is the job or the host, not a device."""
        by_stage: dict[int, list[float | None]] = {}
        outlier: set[int] = set()
        for rank, score in individual.items():
            stage = self.stage_of_rank[rank]
            by_stage.setdefault(stage, []).append(score)
            if relative[rank] > self.config.ratio:
                outlier.add(stage)
        slow = {stage for stage, scores in by_stage.items()
                if stage not in outlier and all(s is not None and s > self.config.ratio for s in scores)}
        return slow if len(slow) < len(by_stage) else set()
