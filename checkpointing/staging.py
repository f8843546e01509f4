"""Local scratch for checkpoint shards on their way to a remote store, shared by every process of a host.

A rank that saves to a remote store (S3) first writes its shards to local disk, then uploads them, then
removes them. A rank killed in between (its node lost, its container restarted, a drill) removes
nothing, and on a real host one killed save of a large model leaves gigabytes behind. The next process
cannot simply clear the folder: other runs, other attempts and, under `failure_domain: replica`, other
replicas whose ranks have the same local numbers save beside it at that moment.

So each process stages into a folder of its own and holds an exclusive `flock` on a lock file in it for
as long as it lives. The kernel drops that lock when the process ends, however it ends (SIGKILL
included), so a folder whose lock can be taken belongs to nobody and is removed: every new area sweeps
its root once. A folder is made under a hidden name, locked, then renamed into place, so a sweep never
sees one that is not locked yet. A hidden one left by a process killed in that instant is removed once
it is PENDING_STALE_S old and unlocked (its owner would have renamed it within microseconds).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

LOCK = ".owner.lock"
"""The file each area's owner holds an exclusive flock on."""
PENDING = ".pending-"
PENDING_STALE_S = 60.0
"""A hidden area this old, and unlocked, was left by a process killed while it made it."""


class StagingArea:
    """This process's folder under `root` (made, locked and the root swept on construction)."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        pending = Path(tempfile.mkdtemp(prefix=PENDING, dir=root))
        name = f"{_safe(label)}-{pending.name.removeprefix(PENDING)}"
        try:
            self._lock_fd: int | None = os.open(pending / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:
            shutil.rmtree(pending, ignore_errors=True)
            raise
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            os.rename(pending, root / name)
        except OSError:  # (let go of it: an fd per failed area would add up over a long run)
            os.close(self._lock_fd)
            shutil.rmtree(pending, ignore_errors=True)
            raise
        self.path = root / name
        """Where this process stages its files (removed by `close`)."""
        self.swept = sweep(root)
        """The abandoned areas this one removed when it was made."""

    def close(self) -> None:
        """Remove this area and let go of it (idempotent)."""
        if self._lock_fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None


def sweep(root: Path) -> list[Path]:
    """Remove the areas under `root` whose owner is gone (their lock is free); what was removed. An area
    whose lock is held, a hidden one still being made (younger than PENDING_STALE_S) and anything not
    made by a StagingArea are left."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(PENDING) and _stale(entry):
            if _remove_if_unlocked(entry, missing_lock_ok=True):
                removed.append(entry)
            continue
        if entry.name.startswith("."):
            continue
        if _remove_if_unlocked(entry, missing_lock_ok=False):
            removed.append(entry)
    return removed


def _stale(entry: Path) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > PENDING_STALE_S
    except OSError:
        return False


def _remove_if_unlocked(entry: Path, *, missing_lock_ok: bool) -> bool:
    """Remove `entry` if nobody holds its lock (with `missing_lock_ok`, also if it has no lock file: a
    process killed before it made one); whether it was removed."""
    try:
        fd = os.open(entry / LOCK, os.O_RDWR)
    except FileNotFoundError:
        if missing_lock_ok and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            return True
        return False
    except OSError:  # not an area (or removed meanwhile)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its owner is alive
        os.close(fd)
        return False
    try:
        shutil.rmtree(entry, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._") or "area"
