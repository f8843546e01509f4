"""Fencing (checkpointing/fence.py): a superseded attempt commits nothing, and what one slips in
between the check and its commit is invisible to every reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointing.fence import Fenced, check, fenced_out, raise_fence, starts
from checkpointing.manifest import Manifest, commit, latest_verified
from checkpointing.store import LocalStore, MemoryStore


def manifest(step: int, attempt: int) -> Manifest:
    return Manifest(run_id="r", step=step, attempt=attempt, mesh={"dp": 1, "pp": 1, "tp": 1}, world_size=1,
                    cursor=step * 8, seeds={"data": 0})


@pytest.mark.parametrize(("step", "attempt", "started", "expected"), [
    (30, 0, {0: 0}, None),                 # the only attempt: stands
    (30, 0, {0: 0, 1: 30}, None),          # committed before attempt 1 started from it
    (40, 0, {0: 0, 1: 30}, 1),             # after attempt 1 started from 30: a zombie's
    (20, 0, {0: 0, 1: 30}, None),          # an older step landing late: the state it holds was trained before
    (40, 1, {0: 0, 1: 30}, None),          # attempt 1's own
    (40, 0, {0: 0, 1: 50, 2: 35}, 2),      # attempt 2 started from 35 (a rollback): 0's step 40 is out
    (40, 1, {0: 0, 1: 30, 2: 45}, None),
])
def test_fenced_out(step: int, attempt: int, started: dict[int, int], expected: int | None) -> None:
    assert fenced_out(step, attempt, started) == expected


def test_a_superseded_attempt_cannot_commit_and_what_it_slipped_in_is_not_loaded(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    raise_fence(store, "r", 0, 0)
    check(store, "r", 0)
    commit(store, manifest(10, 0))
    raise_fence(store, "r", 1, 10)  # the controller replaced attempt 0 (its node cut off) from step 10
    raise_fence(store, "r", 1, 10)  # (idempotent: a retry after a store error)
    assert starts(store, "r") == {0: 0, 1: 10}
    with pytest.raises(Fenced, match="attempt 0 of r is superseded by attempt 1"):
        check(store, "r", 0)  # the zombie's committer, back from the partition
    check(store, "r", 1)
    commit(store, manifest(20, 0))  # one that checked before the fence went up, and commits after it
    found = latest_verified(store, "r", checksums=False)
    assert found is not None
    latest, skipped = found
    assert latest.step == 10, "the zombie's step 20 is invisible"
    assert any("fenced out" in why and "step 20" in why for why in skipped), skipped
    commit(store, manifest(30, 1))
    found = latest_verified(store, "r", checksums=False)
    assert found is not None and found[0].step == 30 and found[0].attempt == 1


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_check_lists_only_the_records_of_later_attempts(kind: str, tmp_path: Path) -> None:
    """A commit late in a long run reads the records after its own attempt, not thousands: the records
    sort by attempt and the listing starts after its own (S3's StartAfter)."""
    store = LocalStore(tmp_path) if kind == "local" else MemoryStore(lambda: 0.0)
    for attempt in range(12):
        raise_fence(store, "r", attempt, attempt * 10)
    listed: list[str] = []
    real_list = store.list

    def listing(prefix: str, *, start_after: str = "") -> list:
        out = real_list(prefix, start_after=start_after)
        listed.extend(o.key for o in out)
        return out

    store.list = listing  # type: ignore[method-assign]
    assert starts(store, "r", after=9) == {10: 100, 11: 110}
    assert starts(store, "r") == {a: a * 10 for a in range(12)}
    listed.clear()
    check(store, "r", 11)
    assert listed == []
    with pytest.raises(Fenced, match="superseded by attempt 11"):
        check(store, "r", 10)
    assert listed == ["r.fence/attempt-00000011-from-0000000110.json"]
    commit(store, manifest(105, 10))  # attempt 10's step before attempt 11 started (from 110): it stands
    commit(store, manifest(115, 10))  # its zombie's, after: fenced out (by the one record listed)
    found = latest_verified(store, "r", checksums=False)
    assert found is not None and found[0].step == 105


def test_a_new_controllers_first_attempt_clears_what_an_earlier_run_of_the_id_left(tmp_path: Path) -> None:
    """`goodput run` numbers its attempts from 0 again; a new run may reuse an id whose checkpoints
    were removed: records of the earlier attempts must not fence the new ones off."""
    store = LocalStore(tmp_path)
    for attempt in range(4):
        raise_fence(store, "r", attempt, attempt * 10)
    raise_fence(store, "r", 0, 30)
    assert starts(store, "r") == {0: 30}
    check(store, "r", 0)
