"""Checkpoint staging areas: a process's shards on their way to a remote store are removed when it ends,
however it ends (here: SIGKILL of a real process holding its area), and never while it lives."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from checkpointing.staging import LOCK, PENDING_STALE_S, StagingArea, sweep

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from checkpointing.staging import StagingArea
    area = StagingArea(Path(sys.argv[1]), sys.argv[2])
    (area.path / "run" / "step-00000004").mkdir(parents=True)
    (area.path / "run" / "step-00000004" / "__0_0.distcp").write_bytes(b"x" * 4096)
    print(area.path, flush=True)
    time.sleep(600)
""")


def _owner(root: Path, label: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(root), label], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_owners_area_is_swept_and_a_live_ones_is_not(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    killed, killed_area = _owner(root, "run-a0-r0")
    alive, alive_area = _owner(root, "run-a0-r0")  # a second replica's rank 0 beside it: the same label
    try:
        assert killed_area != alive_area and killed_area.is_dir() and alive_area.is_dir()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (killed_area / "run" / "step-00000004" / "__0_0.distcp").exists(), "nothing removes it by itself"
        mine = StagingArea(root, "run-a1-r0")
        assert mine.swept == [killed_area]
        assert not killed_area.exists()
        assert (alive_area / "run" / "step-00000004" / "__0_0.distcp").read_bytes() == b"x" * 4096
        assert sweep(root) == [], "a live owner's area and this process's own stay"
        assert mine.path.is_dir()
        mine.close()
        mine.close()
        assert not mine.path.exists()
    finally:
        alive.kill()
        alive.wait()
    assert sweep(root) == [alive_area]
    assert list(root.iterdir()) == []


def test_what_is_not_an_area_is_left(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    (root / "rank-0" / "run" / "step-00000002").mkdir(parents=True)  # an older layout, or someone else's
    (root / ".pending-x").mkdir()  # an area being made (not locked yet)
    (root / ".pending-x" / LOCK).touch()
    (root / "notes.txt").write_text("mine")
    assert sweep(root) == []
    assert sorted(p.name for p in root.iterdir()) == [".pending-x", "notes.txt", "rank-0"]
    assert sweep(tmp_path / "absent") == []


def test_labels_become_folder_names(tmp_path: Path) -> None:
    area = StagingArea(tmp_path, "../team/run 1-a0-r3")
    try:
        assert area.path.parent == tmp_path
        assert area.path.name.startswith("team_run_1-a0-r3-")
    finally:
        area.close()


def test_a_hidden_area_left_by_a_process_killed_while_making_it_is_swept_once_stale(tmp_path: Path) -> None:
    """A process killed between making its hidden folder and renaming it (microseconds apart) leaves it
    unlocked: a sweep removes it once it is PENDING_STALE_S old, never a younger one or a locked one."""
    root = tmp_path / "staging"
    root.mkdir()
    old = time.time() - PENDING_STALE_S - 5
    no_lock, unlocked, locked, young = (root / f".pending-{n}" for n in ("a", "b", "c", "d"))
    for folder in (no_lock, unlocked, locked, young):
        folder.mkdir()
    for folder in (unlocked, locked, young):
        (folder / LOCK).touch()
    held = os.open(locked / LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        for folder in (no_lock, unlocked, locked):
            os.utime(folder, (old, old))
        assert sorted(sweep(root)) == [no_lock, unlocked]
        assert sorted(p.name for p in root.iterdir()) == [".pending-c", ".pending-d"]
    finally:
        os.close(held)
    assert sweep(root) == [locked], "its lock let go: gone at the next sweep"


def test_an_area_that_cannot_be_made_leaves_no_folder_and_no_open_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(src: object, dst: object) -> None:
        raise OSError(5, "Input/output error")

    open_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "rename", fails)
    with pytest.raises(OSError):
        StagingArea(tmp_path, "run-a0-r0")
    assert list(tmp_path.iterdir()) == [] and len(os.listdir("/proc/self/fd")) == open_before
