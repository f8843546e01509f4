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
every stage slower at once (a stage's stragglers aside), is the job or the host, not a device.

The state is arrays over the ranks (each rank's window and baseline, its counts above and below):
an evaluation is a few vectorised passes, so judging 131,072 ranks per step costs milliseconds, and
a simulation can feed a whole step's samples at once (`add_step`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


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



class _Scores(Mapping[int, RankScore]):
    """The scores of the last evaluation, made into RankScores only when asked for (16k ranks, say)."""

    def __init__(self, tracker: "StragglerTracker") -> None:
        self._t = tracker

    def __getitem__(self, rank: int) -> RankScore:
        t = self._t
        if t._relative is None or t._index is None or rank not in t._index:
            raise KeyError(rank)
        i = t._index[rank]
        individual = float(t._individual[i])
        return RankScore(rank=rank, stage=int(t._stage[i]), relative=float(t._relative[i]),
                         individual=None if np.isnan(individual) else individual, straggler=bool(t._flagged[i]))

    def __iter__(self) -> Iterator[int]:
        return iter(self._t._rank_order if self._t._relative is not None else ())

    def __len__(self) -> int:
        return len(self._t._rank_order) if self._t._relative is not None else 0


def _median_without_self(values: np.ndarray) -> np.ndarray:
    """For each value, the median of the others (0.0 where there are none)."""
    n = len(values)
    m = n - 1
    if m <= 0:
        return np.zeros(n)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)

    def at(k: int) -> np.ndarray:  # the k-th smallest of the others: one further along past oneself
        return np.where(k < position, ordered[k], ordered[min(k + 1, n - 1)])

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


class StragglerTracker:
    """Folds (rank, step, compute_s) samples of one attempt into scores; `evaluate` returns the
    verdicts that became true at the newest step every rank has reported."""

    MAX_PENDING_STEPS = 256
    """Steps kept waiting for their last ranks' samples; older ones are dropped unevaluated."""

    def __init__(self, stage_of_rank: Mapping[int, int], config: StragglerConfig) -> None:
        """`stage_of_rank`: any read-only mapping (kept, not copied: a mesh's is computed, not stored);
        one that also has `ranks()` and `stages()` (controller.attribution.MeshStages) gives its rank
        order and every rank's stage as a range and an array. The tracker's arrays are built at its
        first evaluation: an attempt that never judges costs nothing."""
        if not stage_of_rank:
            raise ValueError("a straggler tracker needs at least one rank")
        self.stage_of_rank = stage_of_rank
        self._ranks = len(stage_of_rank)
        self.config = config
        self._by_step: dict[int, dict[int, float]] = {}
        self._whole: dict[int, np.ndarray] = {}
        """Steps given at once (`add_step`), in rank order."""
        self._ready: set[int] = set()
        """Pending steps every rank has reported (kept as they fill: a poll need not scan the pending)."""
        self._evaluated = 0
        self._first_step: int | None = None
        self._rank_order: Sequence[int] = ()
        self._index: Mapping[int, int] | range | None = None
        """rank -> its position in the arrays (a range where the ranks are 0..n-1)."""
        self._relative: np.ndarray | None = None
        self.scores: Mapping[int, RankScore] = _Scores(self)

    def add(self, rank: int, step: int, compute_s: float) -> None:
        if rank not in self.stage_of_rank or not self._fresh(step):
            return
        samples = self._by_step.setdefault(step, {})
        samples[rank] = compute_s
        if len(samples) >= self._ranks:
            self._ready.add(step)
        self._bound()

    def add_step(self, step: int, compute_s: Sequence[float] | np.ndarray) -> None:
        """Every rank's compute time of one step at once, in the order `stage_of_rank` lists them."""
        if len(compute_s) != self._ranks:
            raise ValueError(f"add_step: {len(compute_s)} samples for {self._ranks} ranks")
        if self._fresh(step):
            self._whole[step] = np.asarray(compute_s, dtype=np.float64)
            self._by_step.setdefault(step, {})
            self._ready.add(step)
            self._bound()

    def _fresh(self, step: int) -> bool:
        if step <= self._evaluated:
            return False
        if self._first_step is None or step < self._first_step:
            self._first_step = step
        return True

    def _bound(self) -> None:
        if len(self._by_step) > self.MAX_PENDING_STEPS:  # a rank that never reports: forget the oldest
            oldest = next(iter(self._by_step))  # steps arrive in order: the first is the oldest
            del self._by_step[oldest]
            self._whole.pop(oldest, None)
            self._ready.discard(oldest)

    def evaluate(self) -> list[StragglerVerdict]:
        """Consume every step all ranks have reported, in order; new verdicts. A step some rank never
        reported is skipped once a later one is whole (a rank reports its steps in order: the missing
        sample is not coming)."""
        if not self._ready:
            return []
        whole, self._ready = self._ready, set()
        last = max(whole)
        verdicts: list[StragglerVerdict] = []
        for step in sorted(self._by_step):
            if step > last:
                break
            samples = self._by_step.pop(step)
            values = self._whole.pop(step, None)
            if step not in whole:
                continue
            self._evaluated = step
            verdicts.extend(self._evaluate_step(step, samples, values))
        return verdicts

    # -- one step ---------------------------------------------------------------------------------------
    def _arrays(self) -> None:
        """The rank order, the stage of each and the per-rank state, at the first evaluation."""
        c = self.config
        order = getattr(self.stage_of_rank, "ranks", None)
        self._rank_order = order() if callable(order) else list(self.stage_of_rank)
        stages = getattr(self.stage_of_rank, "stages", None)
        self._stage = (stages() if callable(stages)
                       else np.fromiter((self.stage_of_rank[r] for r in self._rank_order), dtype=np.int64))
        n = len(self._rank_order)
        self._index = (range(n) if isinstance(self._rank_order, range) and self._rank_order.start == 0
                       and self._rank_order.step == 1 else {r: i for i, r in enumerate(self._rank_order)})
        self._window = np.zeros((c.window, n))
        self._baseline = np.zeros((max(c.baseline_steps, 1), n))
        self._taken = 0
        """Samples taken (every rank has as many)."""
        self._above = np.zeros(n, dtype=np.int64)
        self._below = np.zeros(n, dtype=np.int64)
        self._flagged = np.zeros(n, dtype=bool)
        self._stage_ids = np.unique(self._stage)
        self._members = [np.flatnonzero(self._stage == s) for s in self._stage_ids]

    def _evaluate_step(self, step: int, samples: dict[int, float], values: np.ndarray | None
                       ) -> list[StragglerVerdict]:
        c = self.config
        assert self._first_step is not None
        if step - self._first_step < c.warmup_steps:
            return []
        if self._index is None:
            self._arrays()
        assert self._index is not None
        if values is None:
            values = np.fromiter((samples[r] for r in self._rank_order), dtype=np.float64, count=len(self._rank_order))
        # The window keeps the newest `window` samples; the one it drops joins the baseline, which
        # keeps the `baseline_steps` before the window.
        if self._taken >= c.window and c.baseline_steps > 0:
            self._baseline[(self._taken - c.window) % c.baseline_steps] = self._window[self._taken % c.window]
        self._window[self._taken % c.window] = values
        self._taken += 1
        if self._taken < c.window:
            return []
        recent = np.median(self._window, axis=0)
        in_baseline = min(max(self._taken - c.window, 0), c.baseline_steps)
        individual = np.full(len(recent), np.nan)
        if in_baseline >= max(c.min_baseline_steps, 1):
            usual = np.median(self._baseline[:in_baseline], axis=0)
            ok = usual > 0
            individual[ok] = recent[ok] / usual[ok]
        relative = np.ones(len(recent))
        for members in self._members:
            typical = _median_without_self(recent[members])
            ok = typical > 0
            relative[members[ok]] = recent[members][ok] / typical[ok]
        slow = self._slow_stage_mask(individual, relative)
        worst = relative.copy()
        by_history = (relative <= c.ratio) & slow
        worst[by_history] = np.where(np.isnan(individual[by_history]) | (individual[by_history] == 0), 1.0,
                                     individual[by_history])
        self._above = np.where(worst > c.ratio, self._above + 1, 0)
        self._below = np.where(worst < 1 + (c.ratio - 1) / 2, self._below + 1, 0)
        flag = ~self._flagged & (self._above >= c.consecutive)
        clear = self._flagged & (self._below >= c.consecutive)
        self._flagged = (self._flagged & ~clear) | flag
        self._relative, self._individual = relative, individual
        return [StragglerVerdict(rank=self._rank_order[int(i)], step=step, score=float(worst[i]),
                                 basis="individual" if by_history[i] else "relative", compute_s=float(recent[i]))
                for i in np.flatnonzero(flag)]

    def _slow_stage_mask(self, individual: np.ndarray, relative: np.ndarray) -> np.ndarray:
        """Ranks of stages whose every rank is slower than its own history, together (none slower than
        its peers), while some other stage is not: a stage-wide slowdown. A stage with a rank slower
        than its peers is that rank's doing (its peers may be slowed with it, sharing its host): the
        relative score names it. When every stage slowed, it is the job or the host, not a device; a
        stage counts as slowed there when its ranks but the ones slower than their peers are (the host
        slowing down while one rank straggles blames neither stage)."""
        ratio = self.config.ratio
        slower_than_peers = relative > ratio
        behind_history = individual > ratio  # NaN (no baseline yet) > ratio is False: not slow
        slowed = [bool(np.all(behind_history[m] | slower_than_peers[m])) for m in self._members]
        if all(slowed):
            return np.zeros(len(relative), dtype=bool)
        mask = np.zeros(len(relative), dtype=bool)
        for members, was_slowed in zip(self._members, slowed):
            if was_slowed and not np.any(slower_than_peers[members]):
                mask[members] = True
        return mask
