"""Hang verdicts from report timings."""

from __future__ import annotations

from health.hang import hang_threshold_s, hang_verdict


def test_threshold_follows_median_with_floor() -> None:
    assert hang_threshold_s([], 3.0, 10.0) == 10.0
    assert hang_threshold_s([1.0, 1.0, 9.0], 3.0, 2.0) == 3.0
    assert hang_threshold_s([0.1] * 5, 3.0, 2.0) == 2.0


def test_progressing_group_is_not_hung() -> None:
    assert hang_verdict(105.0, last_step={0: 5, 1: 5}, last_report_at={0: 104.0, 1: 104.5},
                        recent_step_times=[1.0] * 5, factor=3.0, floor_s=2.0) is None


def test_names_the_rank_that_stopped() -> None:
    v = hang_verdict(120.0, last_step={0: 7, 1: 6, 2: 7}, last_report_at={0: 110.0, 1: 109.0, 2: 110.0},
                     recent_step_times=[1.0] * 5, factor=3.0, floor_s=2.0)
    assert v is not None and v.ranks == (1,) and v.silent_s == 10.0 and v.threshold_s == 3.0


def test_whole_group_stalled() -> None:
    v = hang_verdict(120.0, last_step={0: 7, 1: 7}, last_report_at={0: 100.0, 1: 100.0},
                     recent_step_times=[1.0], factor=3.0, floor_s=5.0)
    assert v is not None and v.ranks == (0, 1)
