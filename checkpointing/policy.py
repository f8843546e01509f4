"""When to checkpoint: the Young/Daly interval. Pure.

With a blocking cost C per checkpoint and a mean time between failures M, the expected waste per
unit time is about C/T + T/(2M), minimised at T = sqrt(2 C M) (Young 1974, Daly 2006).
"""

from __future__ import annotations

import math

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
