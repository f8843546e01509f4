"""A drill report is a pure function of the run's timeline up to the run's first end after the drill. A
drill whose run its owner cancelled before it recovered says `cancelled`, and a resume that follows
changes nothing in it: the README's walkthrough (tests/cluster/test_readme_service.py) once saw a
bitflip drill, cancelled in the middle of its recovery, reported `failed` (cached at the cancel) where
the same timeline read afresh after the resume said `recovered` (the resumed attempt's first step)."""

from __future__ import annotations

from controller.drill_reports import DrillReports, drill_reports
from controller.events import Event, EventKind

BITFLIP = {"id": "drill-2", "drill": "bitflip", "target": "7", "step": 45}


def timeline(*rest: tuple[float, int, EventKind, dict]) -> list[Event]:
    first = [Event(10.0, "r", 1, EventKind.DRILL_INJECTED, dict(BITFLIP))]
    return first + [Event(t, "r", a, k, d) for t, a, k, d in rest]


DETECTED = (11.0, 1, EventKind.FAILURE_DETECTED, {"cause": "sdc", "ranks": [7], "step": 46})
DECIDED = (11.1, 1, EventKind.DECISION, {"action": "replace"})
CANCELLED = (11.5, 1, EventKind.CANCELLED, {"step": 46})
RESUMED = [(20.0, 1, EventKind.RESUME_REQUESTED, {"step": None}),
           (21.0, 2, EventKind.ATTEMPT_STARTED, {"start_step": 40, "restore_from": "store"}),
           (23.0, 2, EventKind.FIRST_STEP_AFTER_RECOVERY, {"step": 41, "ended_at": 22.9}),
           (30.0, 2, EventKind.SUCCEEDED, {"step": 60})]


def test_a_drill_cancelled_before_it_recovered_says_cancelled_and_a_later_resume_changes_nothing() -> None:
    cut_short = timeline(DETECTED, DECIDED, CANCELLED)
    (report,) = drill_reports(cut_short)
    assert (report["outcome"], report["decision"], report["recovered_at"]) == ("cancelled", "replace", None)

    resumed = cut_short + [Event(t, "r", a, k, d) for t, a, k, d in RESUMED]
    (again,) = drill_reports(resumed)
    assert again == report, "the resumed attempt's first step is not this drill's recovery"

    # Kept up to date incrementally, event by event, it reads the same as the whole timeline read once.
    kept = DrillReports()
    for n in range(1, len(resumed) + 1):
        assert kept.of(resumed[:n]) == drill_reports(resumed[:n])


def test_a_failed_run_is_a_failed_drill_and_one_recovered_before_the_cancel_stays_recovered() -> None:
    failed = timeline(DETECTED, (11.1, 1, EventKind.FAILED, {"reason": "max_failures"}))
    assert drill_reports(failed)[0]["outcome"] == "failed"

    recovered = timeline(DETECTED, DECIDED, (12.0, 2, EventKind.ATTEMPT_STARTED, {"start_step": 46}),
                         (13.0, 2, EventKind.FIRST_STEP_AFTER_RECOVERY, {"step": 47, "ended_at": 12.9}), CANCELLED)
    (report,) = drill_reports(recovered)
    assert (report["outcome"], report["recovered_at"], report["steps_lost"]) == ("recovered", 12.9, 0)


def test_a_collective_fault_cut_short_by_a_cancel_says_cancelled() -> None:
    events = [Event(10.0, "r", 1, EventKind.DRILL_INJECTED,
                    {"id": "drill-3", "drill": "collective-fault", "target": "0", "step": 5}),
              Event(10.5, "r", 1, EventKind.REPLICA_STEP_DISCARDED, {"step": 6}),
              Event(11.0, "r", 1, EventKind.CANCELLED, {"step": 6})]
    assert drill_reports(events)[0]["outcome"] == "cancelled"
