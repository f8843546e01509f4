"""Checkpoint staging areas: a process's shards on their way to a remote store are removed when it ends,
however it ends (here: SIGKILL of a real process holding its area), and never while it lives."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from checkpointing.staging import LOCK, StagingArea, sweep

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
