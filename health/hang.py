"""Hang verdicts: a pure function of when each rank last reported progress.

A rank is hung when it has reported no step for longer than `factor` x the recent median step time,
never less than `floor_s` (start-up, checkpoints and the first steps are slow; a verdict must not
race the collective timeout that surfaces most stalls first). The verdict names the ranks that
stopped: those behind the furthest step, or all when none is ahead.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class HangVerdict:
    ranks: tuple[int, ...]
    """Ranks that stopped reporting."""
    silent_s: float
    """How long the group has made no progress."""
    threshold_s: float
    """The limit that was crossed."""


def hang_threshold_s(recent_step_times: list[float], factor: float, floor_s: float) -> float:
    if not recent_step_times:
        return floor_s
    return max(floor_s, factor * statistics.median(recent_step_times[-20:]))


def hang_verdict(now: float, *, last_step: dict[int, int], last_report_at: dict[int, float],
                 recent_step_times: list[float], factor: float, floor_s: float) -> HangVerdict | None:
    """None while the group progresses; otherwise who stopped, for how long."""
    if not last_report_at:
        return None
    threshold = hang_threshold_s(recent_step_times, factor, floor_s)
    newest = max(last_report_at.values())
    silent = now - newest
    if silent <= threshold:
        return None
    furthest = max(last_step.values())
    behind = tuple(sorted(r for r, s in last_step.items() if s < furthest))
    return HangVerdict(ranks=behind or tuple(sorted(last_step)), silent_s=silent, threshold_s=threshold)
