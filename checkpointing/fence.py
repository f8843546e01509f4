"""Fencing: only the attempt the controller runs now may commit a checkpoint.

A node cut off by a partition keeps its processes: when its link comes back, a rank of the attempt
the controller has since replaced (a zombie) may still finish an upload and commit. The fence keeps
whatever it does out of the run's state:

- `raise_fence`: before the controller starts attempt A from step S it writes
  `{run}.fence/attempt-{A:08d}-from-{S:010d}.json` with an if-absent put (an S3 conditional write
  where the store has them): one record per attempt, never rewritten, read from one listing of its
  keys (no mutable pointer). Beside the run's prefix, not in it: the listing of `{run}/` after every
  commit (retention) does not grow with the attempts.
- the writer's check (`check`): a committer lists the records and, if one names a later attempt than
  its own, commits nothing and raises `Fenced` (its attempt is superseded; its rank ends).
- the readers' rule (`fenced_out`): the check and the commit are two calls, so a zombie could slip
  a commit in between. A manifest of attempt a at a step after the start step of any later attempt
  b > a was committed after b superseded a: every reader ignores it, as if it did not exist, and the
  controller discards it (checkpointing/manifest.py `latest_verified`).

Pure: the ObjectStore protocol only.
"""

from __future__ import annotations

import json
import re

from checkpointing.store import AlreadyExists, ObjectStore

_RECORD = re.compile(r"attempt-(\d{8})-from-(\d{10})\.json")
"""A record's name under the fence prefix (matched whole: one per attempt, thousands in a long run)."""


class Fenced(RuntimeError):
    """A commit refused: a later attempt has started (this one is superseded)."""


def fence_prefix(run_id: str) -> str:
    return f"{run_id}.fence/"


def raise_fence(store: ObjectStore, run_id: str, attempt: int, start_step: int) -> None:
    """Attempt `attempt` starts from `start_step`: every earlier attempt is fenced off (idempotent: a
    controller that tries again after a store error writes the same record). Attempt 0 is a new
    controller's first (a new run, or `goodput run` starting its attempts over): records an earlier
    one left under this run's id are not its attempts, and go first."""
    if attempt == 0:
        store.delete_prefix(fence_prefix(run_id))
    key = f"{fence_prefix(run_id)}attempt-{attempt:08d}-from-{start_step:010d}.json"
    try:
        store.put_bytes(key, json.dumps({"attempt": attempt, "start_step": start_step}).encode(), if_absent=True)
    except AlreadyExists:
        pass


def starts(store: ObjectStore, run_id: str, *, after: int = -1) -> dict[int, int]:
    """attempt -> the step it started from, for every attempt after `after` the controller fenced for
    (the lowest, should a retry have recorded another). Records sort by attempt, so only the later
    attempts' are listed: a commit late in a run of thousands of attempts reads a few, not thousands."""
    out: dict[int, int] = {}
    prefix = fence_prefix(run_id)
    for obj in store.list(prefix, start_after=f"{prefix}attempt-{after:08d}~" if after >= 0 else ""):
        m = _RECORD.fullmatch(obj.key, len(prefix))
        if m is not None:
            attempt, start = int(m[1]), int(m[2])
            out[attempt] = min(start, out.get(attempt, start))
    return out


def check(store: ObjectStore, run_id: str, attempt: int) -> None:
    """Fenced when a later attempt than `attempt` has started."""
    later = sorted(a for a in starts(store, run_id, after=attempt) if a > attempt)
    if later:
        raise Fenced(f"attempt {attempt} of {run_id} is superseded by attempt {later[-1]}: it commits nothing")


def fenced_out(step: int, attempt: int, started: dict[int, int]) -> int | None:
    """The later attempt that fences off a commit of `step` by `attempt` (it started from an earlier
    step, so the commit came after it), or None when the commit stands."""
    return next((b for b, start in sorted(started.items()) if b > attempt and step > start), None)
