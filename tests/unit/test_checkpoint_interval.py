"""The checkpoint schedule the trainer and the simulator follow: fixed every N, or Young/Daly from the
first save's stall."""

from __future__ import annotations

from checkpointing.schedule import CheckpointInterval


def test_fixed_interval_and_last_step() -> None:
    i = CheckpointInterval(20, auto=False, mtbf_s=None)
    assert [s for s in range(1, 1001) if i.due(s, 1000)][:3] == [20, 40, 60]
    assert i.due(1000, 1000) and not i.due(999, 1000)


def test_auto_interval_follows_young_daly() -> None:
    i = CheckpointInterval(0, auto=True, mtbf_s=3600.0)
    assert i.due(10, 1000) and not i.due(5, 1000)
    detail = i.measured(blocked_s=0.5, step_time_s=0.2)  # sqrt(2 * 0.5 * 3600) = 60 s = 300 steps
    assert i.every == 300 and i.due(300, 1000) and not i.due(310, 1000)
    assert detail is not None and detail["steps"] == 300 and detail["rule"] == "young_daly"
    assert i.measured(blocked_s=5.0, step_time_s=0.2) is None and i.every == 300, "chosen once, from the first save"


def test_auto_starts_from_the_interval_an_earlier_attempt_chose() -> None:
    i = CheckpointInterval(300, auto=True, mtbf_s=3600.0)
    assert i.due(300, 1000) and not i.due(10, 1000)
    assert i.measured(blocked_s=2.0, step_time_s=0.2) is not None and i.every == 600
