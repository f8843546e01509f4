"""make test's exit status from its two pytest sessions (tests/tiers.py)."""

from __future__ import annotations

import signal

from tests.tiers import NO_TESTS_RAN, verdict


def test_a_session_ended_by_a_signal_fails_make_test() -> None:
    """A session that was interrupted or killed (the OOM killer's SIGKILL, a ^C) is Popen's -N: before,
    max(-2, 0) made make test pass with half its tests not run."""
    assert verdict(-signal.SIGINT, 0) == 128 + signal.SIGINT
    assert verdict(0, -signal.SIGKILL) == 128 + signal.SIGKILL
    assert verdict(1, -signal.SIGTERM) == 128 + signal.SIGTERM


def test_failures_and_empty_sessions() -> None:
    assert verdict(0, 0) == 0
    assert verdict(1, 0) == 1
    assert verdict(NO_TESTS_RAN, 0) == 0, "a -k that leaves one tier empty is not a failure"
    assert verdict(NO_TESTS_RAN, 1) == 1
    assert verdict(NO_TESTS_RAN, NO_TESTS_RAN) == NO_TESTS_RAN
