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
sees one that is not locked yet.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path

LOCK = ".owner.lock"
"""The file each area's owner holds an exclusive flock on."""


class StagingArea:
    """This process's folder under `root` (made, locked and the root swept on construction)."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        pending = Path(tempfile.mkdtemp(prefix=".pending-", dir=root))
        self._lock_fd: int | None = os.open(pending / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        name = f"{_safe(label)}-{pending.name.removeprefix('.pending-')}"
        os.rename(pending, root / name)
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
    whose lock is held, a hidden one (still being made) and anything not made by a StagingArea are left."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            fd = os.open(entry / LOCK, os.O_RDWR)
        except OSError:  # not an area (or removed meanwhile)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner is alive
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._") or "area"
