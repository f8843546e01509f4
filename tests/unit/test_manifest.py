"""The commit protocol: no manifest, no step; a corrupted file makes a step unusable and the previous
one is used; retention never removes the newest commit."""

from __future__ import annotations

from pathlib import Path

import yaml

from checkpointing.manifest import (
    Manifest, apply_retention, commit, committed_steps, latest_verified, step_dir,
)
from controller.spec import parse_spec
from controller.state import RunController, RunState
from tests.unit.fakes import FakeWorkerGroup

ROOT = Path(__file__).resolve().parents[2]


def write_step(root: Path, step: int, *, committed: bool = True) -> Path:
    d = step_dir(root, "run", step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    (d / ".metadata").write_bytes(b"meta")
    if committed:
        commit(d, Manifest(run_id="run", step=step, attempt=0, mesh={"dp": 1, "pp": 1, "tp": 1},
                           world_size=1, cursor=step * 4, seeds={"data": 0, "init": 0}))
    return d


def test_uncommitted_step_is_invisible(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    write_step(tmp_path, 20, committed=False)
    assert [s for s, _ in committed_steps(tmp_path, "run")] == [10]
    found = latest_verified(tmp_path, "run")
    assert found is not None and found[0].step == 10


def test_corrupted_shard_falls_back_to_previous(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    d = write_step(tmp_path, 20)
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[100] ^= 0x01
    (d / "__0_0.distcp").write_bytes(bytes(data))
    found = latest_verified(tmp_path, "run")
    assert found is not None
    manifest, directory, skipped = found
    assert manifest.step == 10 and directory.name == "step-00000010"
    assert len(skipped) == 1 and "sha256" in skipped[0]


def test_missing_file_falls_back(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    (write_step(tmp_path, 20) / ".metadata").unlink()
    found = latest_verified(tmp_path, "run")
    assert found is not None and found[0].step == 10 and "missing" in found[2][0]


def test_retention_keeps_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        write_step(tmp_path, step)
    write_step(tmp_path, 35, committed=False)
    assert apply_retention(tmp_path, "run", keep=2) == [10, 20]
    assert [s for s, _ in committed_steps(tmp_path, "run")] == [30, 40]
    assert not step_dir(tmp_path, "run", 35).exists()


def test_controller_resumes_from_latest_verified(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    write_step(tmp_path, 20)
    spec = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run"})
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_root=tmp_path)
    while c.state is not RunState.RUNNING:
        c.step(1.0)
    attempt = group.started[0]
    assert attempt.start_step == 20 and attempt.cursor == 80
    assert attempt.resume_from == str(step_dir(tmp_path, "run", 20))
