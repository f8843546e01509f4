"""Goodput accounting from hand-made timelines: every category is checked against the arithmetic
done by hand, and the categories plus productive time add up to wall time."""

from __future__ import annotations

from typing import Any

import pytest

from controller.accounting import CATEGORIES, StepSpan, account


def ev(time: float, kind: str, attempt: int = 0, **detail: Any) -> dict[str, Any]:
    return {"time": time, "attempt": attempt, "kind": kind, "detail": detail}


def steps(first: int, last: int, start: float, seconds: float = 1.0, attempt: int = 0) -> list[StepSpan]:
    return [StepSpan(step=s, attempt=attempt, start=start + (s - first) * seconds,
                     end=start + (s - first + 1) * seconds) for s in range(first, last + 1)]


def check(result: Any, wall: float, productive: float, **badput: float) -> None:
    assert result.wall_s == pytest.approx(wall)
    assert result.productive_s == pytest.approx(productive)
    expected = {c: 0.0 for c in CATEGORIES} | badput
    assert result.badput_s == pytest.approx(expected), result.badput_s
    assert result.productive_s + sum(result.badput_s.values()) == pytest.approx(result.wall_s, abs=1e-3)
    assert result.ettr == pytest.approx(productive / wall)


def test_no_failure() -> None:
    spans = steps(1, 5, 5.0) + steps(6, 10, 10.5)  # a save after step 5 holds the loop 0.5 s
    events = [ev(0.0, "submitted"), ev(2.0, "planned"), ev(2.0, "attempt_started"),
              ev(12.0, "checkpoint_committed", step=5), ev(16.0, "succeeded")]
    check(account(events, spans, end=16.0, save_steps=[5]), wall=16.0, productive=10.0,
          queueing=2.0, startup=3.0, checkpoint_stall=0.5, other=0.5)


def test_kill_node_with_rollback() -> None:
    # Attempt 0 finishes steps 1-7 (a commit at 5); a node is killed in step 8; the spare resumes from 5.
    spans = steps(1, 7, 2.0) + steps(6, 10, 14.0, attempt=1)
    events = [ev(0.0, "submitted"), ev(1.0, "attempt_started"), ev(7.2, "checkpoint_committed", step=5),
              ev(9.4, "drill_injected", drill="kill-node"), ev(10.4, "failure_detected", cause="node_lost"),
              ev(10.4, "decision", action="replace"), ev(11.0, "attempt_started", attempt=1),
              ev(19.5, "succeeded", attempt=1)]
    result = account(events, spans, end=19.5, save_steps=[5])
    check(result, wall=19.5, productive=10.0,
          queueing=1.0, startup=1.0, recomputation=2.0 + 0.4, failure_detection=1.0, restart_restore=3.6,
          other=0.5)
    # Per attempt: attempt 0 owns [submitted, attempt 1 started), attempt 1 the rest.
    first, second = result.attempts
    check(first, wall=11.0, productive=5.0, queueing=1.0, startup=1.0, recomputation=2.4, failure_detection=1.0,
          restart_restore=0.6)
    check(second, wall=8.5, productive=5.0, restart_restore=3.0, other=0.5)
    assert (first.attempt, second.attempt) == (0, 1)
    (failure,) = result.failures
    assert (failure.cause, failure.onset, failure.detection_s, failure.recovery_s) == ("node_lost", 9.4,
                                                                                       pytest.approx(1.0), pytest.approx(3.6))
    # Its lost work on its own: steps 6 and 7 done again (2 s) and step 8 in flight (0.4 s)
    d = failure.to_dict()
    assert d["recomputation_seconds"] == pytest.approx(2.4) and d["waiting_seconds"] == 0.0
    assert d["lost_seconds"] == pytest.approx(1.0 + 3.6 + 2.4)


def test_wait_below_min_dp() -> None:
    spans = steps(1, 3, 1.0) + steps(4, 5, 22.0, attempt=1)
    events = [ev(0.0, "submitted"), ev(0.0, "attempt_started"), ev(5.0, "failure_detected", cause="node_lost"),
              ev(5.5, "decision", action="wait"), ev(20.0, "attempt_started", attempt=1),
              ev(24.0, "succeeded", attempt=1)]
    result = account(events, spans, end=24.0)
    check(result, wall=24.0, productive=5.0,
          startup=1.0, failure_detection=1.0, restart_restore=0.5 + 2.0, waiting_for_capacity=14.5)
    assert result.failures[0].recovery_s == pytest.approx(17.0)  # the wait counts in recovery
    assert result.failures[0].waiting_s == pytest.approx(14.5)  # and is shown on its own


def test_straggler() -> None:
    spans = steps(1, 4, 1.0) + [StepSpan(5, 0, 5.0, 6.5), StepSpan(6, 0, 6.5, 8.0)]
    events = [ev(0.0, "submitted"), ev(0.0, "attempt_started"), ev(5.0, "straggler", rank=3, step=4),
              ev(8.0, "succeeded")]
    check(account(events, spans, end=8.0), wall=8.0, productive=6.0, startup=1.0, straggler_slowdown=1.0)


def test_a_live_run_is_accounted_up_to_now_and_a_timeline_needs_its_start() -> None:
    events = [ev(10.0, "submitted"), ev(12.0, "attempt_started")]
    result = account(events, steps(1, 2, 13.0), end=16.0)
    check(result, wall=6.0, productive=2.0, queueing=2.0, startup=1.0, other=1.0)
    check(result.attempts[0], wall=6.0, productive=2.0, queueing=2.0, startup=1.0, other=1.0)
    # A failure not yet recovered from has no recovery time.
    unrecovered = account(events + [ev(15.5, "failure_detected", cause="hang")], steps(1, 2, 13.0), end=16.0)
    assert unrecovered.failures[0].recovered_at is None and unrecovered.failures[0].detection_s == 0.5
    with pytest.raises(ValueError, match="submitted"):
        account([ev(1.0, "attempt_started")], [], end=2.0)


def test_a_restored_history_gives_the_accounting_its_kept_steps() -> None:
    from controller.progress import RunProgress

    progress = RunProgress()
    progress.restore([{"step": 1, "loss": 2.0, "attempt": 0, "start": 1.0, "end": 2.0},
                      {"step": 2, "loss": 1.5, "attempt": 0, "start": None, "end": None}])  # an old registry row
    assert progress.spans == [StepSpan(1, 0, 1.0, 2.0)] and progress.step == 2
    result = account([ev(0.0, "submitted"), ev(0.5, "attempt_started")], progress.spans, end=3.0)
    check(result, wall=3.0, productive=1.0, queueing=0.5, startup=0.5, other=1.0)


def test_steps_reported_by_different_ranks_do_not_overlap() -> None:
    """Rank 1 reports step 1 (its step ended at 2.0); rank 0's report of step 2 comes first for that
    step and says it took 1.05 s to 2.98: it began before step 1 ended on rank 1. The kept steps are
    one timeline, so step 2 starts at 2.0 and the productive time is the steps' sum."""
    from controller.progress import RunProgress
    from trainer.report import StepReport

    def report(rank: int, step: int, end: float, took: float) -> StepReport:
        return StepReport(rank=rank, attempt=0, step=step, cursor=step * 8, loss=1.0, step_time_s=took, data_s=0.0,
                          compute_s=took, wait_s=0.0, tokens_per_s=1.0, end_time=end)

    progress = RunProgress()
    assert progress.add(report(1, 1, 2.0, 1.0)) and progress.add(report(0, 2, 2.98, 1.05))
    assert [(s.start, s.end) for s in progress.spans] == [(1.0, 2.0), (2.0, 2.98)]
    assert [(h["start"], h["end"]) for h in progress.history] == [(1.0, 2.0), (2.0, 2.98)]
    result = account([ev(0.0, "submitted"), ev(0.5, "attempt_started")], progress.spans, end=3.0)
    kept = sum(h["end"] - h["start"] for h in progress.history)
    check(result, wall=3.0, productive=kept, queueing=0.5, startup=0.5, other=3.0 - 1.0 - kept)


def test_a_step_heard_after_the_next_one_is_not_a_rollback() -> None:
    """A rank's report waits for its peer snapshot's copy, so one rank's step 2 can be heard after
    another's step 3 (dp2: two last-stage ranks). The same attempt never goes back: nothing is
    recomputed (a drain test in CI charged 2 ms of recomputation: step 3 counted twice). A later
    attempt's step 2 is a rollback, and loses what came after it."""
    from controller.progress import RunProgress
    from trainer.report import StepReport

    def report(rank: int, step: int, end: float, attempt: int = 0) -> StepReport:
        return StepReport(rank=rank, attempt=attempt, step=step, cursor=step * 8, loss=1.0, step_time_s=1.0,
                          data_s=0.0, compute_s=1.0, wait_s=0.0, tokens_per_s=1.0, end_time=end)

    progress = RunProgress()
    heard = [report(0, 1, 2.0), report(1, 1, 2.001), report(1, 2, 3.0), report(1, 3, 4.0),
             report(0, 2, 3.002), report(0, 3, 4.001), report(0, 4, 5.0), report(1, 4, 5.001)]
    assert [progress.add(r) for r in heard] == [True, False, True, True, False, False, True, False]
    assert [(h["step"], h["end"]) for h in progress.history] == [(1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0)]
    events = [ev(0.0, "submitted"), ev(0.5, "attempt_started")]
    check(account(events, progress.spans, end=5.0), wall=5.0, productive=4.0, queueing=0.5, startup=0.5)

    late = RunProgress()  # step 2's first report comes after step 3's: it goes in its place
    assert [late.add(r) for r in (report(1, 1, 2.0), report(1, 3, 4.0), report(0, 2, 3.0), report(1, 2, 3.0))] \
        == [True, True, True, False]
    assert [h["step"] for h in late.history] == [1, 2, 3] and late.step == 3
    check(account(events, late.spans, end=4.0), wall=4.0, productive=3.0, queueing=0.5, startup=0.5)

    assert late.add(report(0, 2, 6.0, attempt=1))  # attempt 1 redoes step 2: step 3 of attempt 0 is lost
    assert [(h["step"], h["attempt"]) for h in late.history] == [(1, 0), (2, 1)]


DP2 = {"dp": 2, "pp": 2, "tp": 2}
DP1 = {"dp": 1, "pp": 2, "tp": 2}


def test_a_shrunk_mesh_is_productive_only_in_proportion_to_its_throughput() -> None:
    """Planned dp2 (8 ranks) takes 1 s a step; no spare after a node loss, so dp1 (4 ranks) carries the
    same global batch at 2 s a step: half its step time is degraded capacity, not goodput."""
    spans = steps(1, 5, 1.0) + steps(6, 10, 10.0, seconds=2.0, attempt=1)
    events = [ev(0.0, "submitted"), ev(0.0, "planned", mesh=DP2), ev(0.0, "attempt_started", mesh=DP2),
              ev(7.0, "failure_detected", cause="node_lost"), ev(7.0, "decision", action="shrink"),
              ev(8.0, "attempt_started", attempt=1, mesh=DP1), ev(20.0, "succeeded", attempt=1)]
    result = account(events, spans, end=20.0)
    check(result, wall=20.0, productive=5.0 + 5.0, startup=1.0, failure_detection=1.0, restart_restore=3.0,
          degraded_capacity=5.0)
    check(result.attempts[1], wall=12.0, productive=5.0, restart_restore=2.0, degraded_capacity=5.0)
    (failure,) = result.to_dict()["failures"]  # the shrink's price, charged to the failure that forced it
    assert failure["degraded_seconds"] == pytest.approx(5.0) and failure["lost_seconds"] == pytest.approx(4.0)


def test_with_no_step_on_the_planned_mesh_a_shrunk_one_counts_its_share_of_the_ranks() -> None:
    """A run restored with none of its planned mesh's steps kept: dp1 of a planned dp2 holds half the
    ranks, so half its kept step time is degraded capacity (ideal scaling)."""
    spans = steps(1, 4, 2.0, attempt=1)
    events = [ev(0.0, "submitted"), ev(0.0, "planned", mesh=DP2), ev(1.0, "attempt_started", attempt=1, mesh=DP1),
              ev(6.0, "succeeded", attempt=1)]
    check(account(events, spans, end=6.0), wall=6.0, productive=2.0, queueing=1.0, startup=1.0,
          degraded_capacity=2.0)


def test_a_recovery_splits_into_restart_and_the_slowest_ranks_restore() -> None:
    """The timeline of test_kill_node_with_rollback, where attempt 1's ranks report their loads of
    step 5 (1.1 s, 1.5 s, 0.9 s): of the 3.6 s recovery, 1.5 s restore (the slowest rank: the others
    wait for it), 2.1 s restart."""
    spans = steps(1, 7, 2.0) + steps(6, 10, 14.0, attempt=1)
    events = [ev(0.0, "submitted"), ev(1.0, "attempt_started"), ev(7.2, "checkpoint_committed", step=5),
              ev(9.4, "drill_injected", drill="kill-node"), ev(10.4, "failure_detected", cause="node_lost"),
              ev(10.4, "decision", action="replace"), ev(11.0, "attempt_started", attempt=1),
              *[ev(13.9, "restored", attempt=1, rank=r, step=5, seconds=s) for r, s in enumerate((1.1, 1.5, 0.9))],
              ev(19.5, "succeeded", attempt=1)]
    (failure,) = account(events, spans, end=19.5, save_steps=[5]).failures
    d = failure.to_dict()
    assert d["recovery_seconds"] == pytest.approx(3.6)
    assert d["restore_seconds"] == pytest.approx(1.5) and d["restart_seconds"] == pytest.approx(2.1)
    assert d["lost_seconds"] == pytest.approx(1.0 + 2.1 + 1.5 + 2.4)


def overlapping_outs(batch: str) -> tuple[list[dict[str, Any]], list[StepSpan]]:
    """Four replicas, 1 s a step with all of them in. Replica 1 is lost at 10 s (failure A), replica 2
    at 14 s (failure B) while 1 is still out; 1 rejoins at 20 s, 2 at 24 s. Keeping the batch, a step
    with k of 4 out takes 4/(4-k) s; shrinking it, 1 s."""
    def took(k: int) -> float:
        return 4 / (4 - k) if batch == "keep" else 1.0

    spans, t = [], 0.0
    for first, last, k in ((1, 10, 0), (11, 13, 1), (14, 16, 2), (17, 19, 1), (20, 21, 0)):
        spans += steps(first, last, t, seconds=took(k))
        t += (last - first + 1) * took(k)
    a, b, back_a, back_b = 10.0, 10.0 + 3 * took(1), 10.0 + 3 * took(1) + 3 * took(2), t - 2.0
    mesh = {"dp": 4, "pp": 1, "tp": 1}
    events = [ev(0.0, "submitted"), ev(0.0, "planned", mesh=mesh), ev(0.0, "attempt_started", mesh=mesh),
              ev(a, "failure_detected", cause="node_lost", replicas=[1]),
              ev(a, "replica_lost", replicas=[1], live=3, of=4, batch=batch),
              ev(b, "failure_detected", cause="node_lost", replicas=[2]),
              ev(b, "replica_lost", replicas=[2], live=2, of=4, batch=batch),
              ev(back_a, "replica_rejoined", replicas=[1], at=back_a, seconds=0.0),
              ev(back_b, "replica_rejoined", replicas=[2], at=back_b, seconds=0.0), ev(t, "succeeded")]
    return events, spans


@pytest.mark.parametrize("batch", ["keep", "shrink"])
def test_overlapping_replica_losses_charge_each_step_k_of_d_once(batch: str) -> None:
    """By hand: a step begun with k of 4 replicas out trains (4-k)/4 of what the full mesh would, so
    keeping the batch every step's productive time is the full mesh's 1 s (the rest, k/4 of a longer
    step, is degraded), and shrinking it a step of 1 s is (4-k)/4 productive. Each out replica's
    quarter goes to the failure that took it out: overlapping failures never charge a step twice (a
    span's median slowdown charged per failure charged keep 8 s of degraded capacity for 5)."""
    events, spans = overlapping_outs(batch)
    wall = spans[-1].end
    result = account(events, spans, end=wall)
    if batch == "keep":  # 26 s: 21 steps of 1 s of work; A's quarter of 3 steps of 4/3 s and 3 of 2 s, B's of 3 of 2 s and 3 of 4/3 s
        per_failure = 3 * (4 / 3) / 4 + 3 * 2 / 4
        check(result, wall=26.0, productive=21.0, degraded_capacity=2 * per_failure)
    else:  # 21 s of steps, each replica's quarter of the 6 steps it missed
        per_failure = 6 * 1.0 / 4
        check(result, wall=21.0, productive=21.0 - 2 * per_failure, degraded_capacity=2 * per_failure)
    assert result.degraded_s == pytest.approx({"smaller_mesh": 0.0, "replicas_out": 2 * per_failure})
    a, b = result.failures
    assert a.contained and b.contained
    assert (a.degraded_s, b.degraded_s) == (pytest.approx(per_failure), pytest.approx(per_failure))
    assert a.rejoined_at == pytest.approx(20.0 if batch == "keep" else 16.0)


def test_a_replica_out_on_a_shrunk_mesh_pays_both_shares() -> None:
    """Planned dp4 in 4 replicas, 1 s a step. No node to spare: attempt 1 runs dp2 (2 replicas, 2 s a
    step, throughput 1/2), and one of its replicas is out for two steps keeping the batch (4 s each).
    A 4 s step trains what the planned mesh does in 1 s: 2 s of it is the smaller mesh's, 1 s the
    missing replica's (half of what the smaller mesh trained)."""
    dp4, dp2 = {"dp": 4, "pp": 1, "tp": 1}, {"dp": 2, "pp": 1, "tp": 1}
    spans = steps(1, 4, 0.0) + steps(5, 6, 5.0, seconds=2.0, attempt=1) + steps(7, 8, 9.0, seconds=4.0, attempt=1) \
        + steps(9, 10, 17.0, seconds=2.0, attempt=1)
    events = [ev(0.0, "submitted"), ev(0.0, "planned", mesh=dp4), ev(0.0, "attempt_started", mesh=dp4),
              ev(4.0, "failure_detected", cause="node_lost"), ev(4.0, "decision", action="shrink"),
              ev(4.5, "attempt_started", attempt=1, mesh=dp2),
              ev(9.0, "failure_detected", attempt=1, cause="node_lost", replicas=[1]),
              ev(9.0, "replica_lost", attempt=1, replicas=[1], live=1, of=2, batch="keep"),
              ev(17.0, "replica_rejoined", attempt=1, replicas=[1], at=17.0, seconds=0.0),
              ev(21.0, "succeeded", attempt=1)]
    result = account(events, spans, end=21.0)
    check(result, wall=21.0, productive=4.0 + 6 * 1.0, restart_restore=1.0,
          degraded_capacity=(4 * 2.0 + 2 * 4.0) / 2 + 2 * 1.0)
    assert result.degraded_s == pytest.approx({"smaller_mesh": 8.0, "replicas_out": 2.0})
    shrink, contained = result.failures
    assert shrink.degraded_s == pytest.approx(8.0) and contained.degraded_s == pytest.approx(2.0)
    assert result.ettr == pytest.approx(10.0 / 21.0)
