"""When to checkpoint: every N steps, or `auto` (the Young/Daly interval). Pure; the trainer and the
simulator both follow `CheckpointInterval`, so a simulated run saves at the steps a real one would.

With a blocking cost C per checkpoint and a mean time between failures M, the expected waste per
unit time is about C/T + T/(2M), minimised at T = sqrt(2 C M) (Young 1974, Daly 2006).
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_MTBF_S = 24 * 3600.0


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"save cost {save_cost_s} s and MTBF {mtbf_s} s must be >= 0 and > 0")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def interval_steps(save_cost_s: float, mtbf_s: float, step_time_s: float, *, max_steps: int | None = None) -> int:
    """The Young/Daly interval in whole steps (at least 1, at most max_steps)."""
    steps = max(1, round(young_daly_interval_s(save_cost_s, mtbf_s) / max(step_time_s, 1e-9)))
    return min(steps, max_steps) if max_steps else steps


def observed_mtbf_s(run_seconds: float, failures: int, configured_s: float | None) -> float:
    """The run's own MTBF once it has failed; before that the configured one (or a day)."""
    if failures > 0:
        return run_seconds / failures
    return configured_s or DEFAULT_MTBF_S


FIRST_AUTO_STEP = 10
"""`auto` with no interval from an earlier attempt: the first save is at step 10; its cost sets the interval."""


class CheckpointInterval:
    """Fixed every N steps (and the last step), or `auto`: the interval an earlier attempt chose (the
    controller passes it), else a first save at FIRST_AUTO_STEP; either way the attempt's first measured
    save sets it again by Young/Daly (the MTBF may have changed)."""

    def __init__(self, every: int, *, auto: bool, mtbf_s: float | None) -> None:
        self.every = every if not auto else (every or FIRST_AUTO_STEP)
        self.auto = auto
        self.mtbf_s = mtbf_s or DEFAULT_MTBF_S
        self.chosen = not auto

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or step % self.every == 0

    def measured(self, blocked_s: float, step_time_s: float) -> dict[str, Any] | None:
        """A save blocked training `blocked_s`: with `auto`, the first one chooses the interval; the
        detail of the `checkpoint_interval` event it chose, else None."""
        if self.chosen:
            return None
        self.every = interval_steps(blocked_s, self.mtbf_s, step_time_s)
        self.chosen = True
        return {"steps": self.every, "save_cost_s": blocked_s, "mtbf_s": self.mtbf_s, "step_time_s": step_time_s,
                "rule": "young_daly"}
