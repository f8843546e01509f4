"""Straggler scores and verdicts: a pure function of per-rank compute times (no torch, no ray).

Scores use each rank's own compute time, never its step time: a slow rank computes long while its
peers wait long in collectives and pipeline receives, so step times would blame the waiters.

Over a sliding window of the last `window` steps, a rank's value is the median of its compute times
(one slow step is noise, not a straggler). Two scores per rank:
- relative: its value / the median of its peers' values in the same pipeline stage (peers run the
  same layers on the same amount of data, so they should take the same time);
- individual: its value / its own baseline (the median of its first `baseline_steps` steps of the
  attempt): catches a whole stage slowing down, where every peer is slow too.
A rank becomes a straggler after `consecutive` evaluations in a row above `ratio`, and stops being
one only after as many in a row below half the excess (1 + (ratio - 1) / 2): hysteresis, so a rank
whose score hovers near the bound is flagged once, not on and off.
Relative verdicts name one GPU worth replacing; individual-only verdicts (a whole stage or the whole
job slowed) are reported, never acted on.
"""

from __future__ import annotations

import statistics
from collections import deque
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
    baseline_steps: int = 5
    """Steps after warm-up whose median is a rank's own baseline."""


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
    samples: deque = field(default_factory=deque)
    baseline: list[float] = field(default_factory=list)
    above: int = 0
    below: int = 0
    flagged: bool = False


class StragglerTracker:
    """Folds (rank, step, compute_s) samples of one attempt into scores; `evaluate` returns the
    verdicts that became true at the newest step every rank has reported."""

    def __init__(self, stage_of_rank: dict[int, int], config: StragglerConfig) -> None:
        if not stage_of_rank:
            raise ValueError("a straggler tracker needs at least one rank")
        self.stage_of_rank = dict(stage_of_rank)
        self.config = config
        self._ranks = {r: _Rank() for r in stage_of_rank}
        self._by_step: dict[int, dict[int, float]] = {}
        self._evaluated = 0
        self._first_step: int | None = None
        self.scores: dict[int, RankScore] = {}

    def add(self, rank: int, step: int, compute_s: float) -> None:
        if rank not in self._ranks or step <= self._evaluated:
            return
        if self._first_step is None or step < self._first_step:
            self._first_step = step
        self._by_step.setdefault(step, {})[rank] = compute_s

    def evaluate(self) -> list[StragglerVerdict]:
        """Consume every step all ranks have reported, in order; new verdicts."""
        verdicts: list[StragglerVerdict] = []
        for step in sorted(self._by_step):
            samples = self._by_step[step]
            if len(samples) < len(self._ranks):
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
            state = self._ranks[rank]
            state.samples.append(value)
            if len(state.samples) > c.window:
                state.samples.popleft()
            if len(state.baseline) < c.baseline_steps:
                state.baseline.append(value)
        if any(len(s.samples) < c.window for s in self._ranks.values()):
            return []
        values = {r: statistics.median(s.samples) for r, s in self._ranks.items()}
        verdicts = []
        for rank, value in values.items():
            state = self._ranks[rank]
            stage = self.stage_of_rank[rank]
            peers = [values[r] for r, st in self.stage_of_rank.items() if st == stage and r != rank]
            relative = value / statistics.median(peers) if peers and statistics.median(peers) > 0 else 1.0
            individual = (value / statistics.median(state.baseline)
                          if len(state.baseline) == c.baseline_steps and statistics.median(state.baseline) > 0
                          else None)
            worst, basis = relative, "relative"
            if relative <= c.ratio and individual is not None and individual > c.ratio:
                worst, basis = individual, "individual"
            state.above = state.above + 1 if worst > c.ratio else 0
            state.below = state.below + 1 if worst < 1 + (c.ratio - 1) / 2 else 0
            if not state.flagged and state.above >= c.consecutive:
                state.flagged = True
                verdicts.append(StragglerVerdict(rank=rank, step=step, score=worst, basis=basis, compute_s=value))
            elif state.flagged and state.below >= c.consecutive:
                state.flagged = False
            self.scores[rank] = RankScore(rank=rank, stage=stage, relative=relative, individual=individual,
                                          straggler=state.flagged)
        return verdicts
