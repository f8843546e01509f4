"""A rank that dies mid-save leaves the step invisible; the previous step stays the latest."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointing.manifest import committed_steps, latest_verified, read_manifest, step_prefix, verify
from checkpointing.store import LocalStore
from tests.dist.ckpt_faults import die_mid_save, resave_committed_step, resume_step
from tests.dist.harness import run_ranks
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_to_dict

pytestmark = pytest.mark.dist


def small(dp: int = 2) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        data=DataConfig(seed=0),
        train=TrainConfig(steps=6, global_batch=4, micro_batch=2, lr=1e-2, dtype="float32"),
        mesh=MeshShape(dp=dp),
    )


def test_rank_killed_mid_save_leaves_no_manifest(tmp_path: Path) -> None:
    results = run_ranks(die_mid_save, 2, may_die=frozenset({1}), config=config_to_dict(small()), root=str(tmp_path))
    assert results[1] is None, "rank 1 was meant to die"
    store = LocalStore(tmp_path)
    assert committed_steps(store, "crash") == [2]
    found = latest_verified(store, "crash")
    assert found is not None and found[0].step == 2
    step4 = tmp_path / step_prefix("crash", 4)
    assert (step4 / "__1_0.distcp").exists(), "rank 1 did write its shard before dying"
    assert not (step4 / "manifest.json").exists()
    kinds = [k for k, _ in results[0]["events"]]
    assert kinds == ["checkpoint_committed", "checkpoint_failed"]
    assert "could not confirm that all 2 ranks wrote their shards" in results[0]["events"][1][1]["error"]


def test_a_committed_step_is_never_written_again(tmp_path: Path) -> None:
    """The second save of step 2 is refused on every rank before a shard is written: the committed
    files keep their bytes and the step still verifies byte for byte."""
    results = run_ranks(resave_committed_step, 2, config=config_to_dict(small()), root=str(tmp_path))
    store = LocalStore(tmp_path)
    manifest = read_manifest(store, "resave", 2)
    verify(store, manifest)  # raises if a shard was overwritten
    for result in results:
        assert result["skipped"] is not None and "already committed" in result["skipped"]
    kinds = [k for k, _ in results[0]["events"]]
    assert kinds == ["checkpoint_committed", "checkpoint_skipped"]
    assert [k for k, _ in results[1]["events"]] == []


def test_a_rank_that_reads_a_flipped_byte_fails_the_load_everywhere(tmp_path: Path) -> None:
    """No one re-reads a step before loading it any more: the loading ranks check each item against
    its digest. A byte flipped inside one item of rank 1's file (same size, so a listing cannot see
    it) fails the load on every rank with the item named, and rank 0 reports `restore_failed` for
    the controller; no rank trains on the bad state. The whole-file check agrees independently."""
    results = run_ranks(resave_committed_step, 2, config=config_to_dict(small()), root=str(tmp_path))
    store = LocalStore(tmp_path)
    manifest = read_manifest(store, "resave", 2)
    offset, length, _ = manifest.files["__1_0.distcp"]["items"][-1]
    path = tmp_path / step_prefix("resave", 2) / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256"):
        verify(store, manifest)
    results = run_ranks(resume_step, 2, config=config_to_dict(small()), uri=f"file://{tmp_path}", run_id="resave", step=2)
    for result in results:
        assert result["step"] is None, "no rank may train on a step that failed its check"
        assert "CheckpointError" in result["error"] and f"the {length} bytes at {offset} fail their sha256 check" in result["error"]
    failed = [d for k, d in results[0]["events"] if k == "restore_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and "__1_0.distcp" in failed[0]["error"]
    assert not [k for k, _ in results[1]["events"] if k == "restore_failed"]
