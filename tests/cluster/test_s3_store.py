"""The S3 store against a real S3-protocol server (moto server mode on 127.0.0.1): multipart, ranged
reads, conditional commits, retries through a short outage, a clean failure after a long one, and a
full checkpoint round trip through the trainer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from checkpointing.manifest import CheckpointError, Manifest, commit, committed_steps, latest_verified
from checkpointing.store import S3Store, StoreError, open_store
from tests.dist.harness import run_ranks
from tests.dist.reshard import load_on_mesh, save_on_mesh
from tests.dist.test_reshard import config, merged
from tests.support.s3 import S3Server
from trainer.config import config_to_dict

pytestmark = pytest.mark.cluster


def test_multipart_upload_and_ranged_reads(bucket: str, tmp_path: Path) -> None:
    store = S3Store(bucket, "run", part_size=5 * 2**20)
    data = os.urandom(12 * 2**20 + 123)  # three parts
    (tmp_path / "big").write_bytes(data)
    store.put_file("a/big", tmp_path / "big")
    assert store.get_bytes("a/big") == data
    assert store.get_bytes("a/big", 5 * 2**20 - 3, 5 * 2**20 + 5) == data[5 * 2**20 - 3: 5 * 2**20 + 5]
    head = store.client.head_object(Bucket=bucket, Key="run/a/big")
    assert head["ETag"].strip('"').endswith("-3"), "the upload went multipart in 3 parts"
    store.download("a/big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
    assert [(o.key, o.size) for o in store.list("a/")] == [("a/big", len(data))]
    store.put_bytes("a/c", b"c")
    assert [o.key for o in store.list("a/", start_after="a/big")] == ["a/c"]  # S3's StartAfter
    store.delete_prefix("a/")
    assert store.list("a/") == []


def test_manifest_commits_once_on_s3(bucket: str) -> None:
    store = open_store(f"s3://{bucket}/ckpt")
    m = Manifest(run_id="r", step=3, attempt=0, mesh={}, world_size=1, cursor=0, seeds={})
    commit(store, m)
    with pytest.raises(CheckpointError, match="already committed"):
        commit(store, Manifest(**{**m.__dict__, "attempt": 1}))
    assert committed_steps(store, "r") == [3]


def test_short_outage_is_retried(bucket: str, s3_server: S3Server) -> None:
    store = S3Store(bucket, "p", retry_budget_s=20)
    s3_server.proxy.fail_next_writes(3)
    t0 = time.monotonic()
    store.put_bytes("k", b"v")
    assert s3_server.proxy.refused == 3
    assert store.get_bytes("k") == b"v"
    assert time.monotonic() - t0 < 20


def test_long_outage_fails_clearly_then_recovers(bucket: str, s3_server: S3Server) -> None:
    store = S3Store(bucket, "p", retry_budget_s=1.5)
    s3_server.proxy.refuse_writes_for(60)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"put of k on s3://.* failed for .* s \(retried within a 2 s budget\)"):
        store.put_bytes("k", b"v")
    assert time.monotonic() - t0 < 10, "an outage must end in an error, not a hang"
    s3_server.proxy.heal()
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"


def test_checkpoint_round_trip_on_s3_is_bit_identical(bucket: str) -> None:
    uri = f"s3://{bucket}/runs"
    saved = merged(run_ranks(save_on_mesh, 4, config=config_to_dict(config(2, 1, 2)), uri=uri))
    store = open_store(uri)
    found = latest_verified(store, "reshard")
    assert found is not None and found[0].step == 2
    assert found[0].files and all(k.startswith(("__", ".metadata")) for k in found[0].files)
    results = run_ranks(load_on_mesh, 4, config=config_to_dict(config(2, 1, 2)), uri=uri, step=2)
    loaded = merged([r["state"] for r in results])
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_training_goes_on_through_a_failed_save(bucket: str, s3_server: S3Server,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2's save meets a short outage (retried, committed); step 4's meets a long one (fails
    cleanly); training finishes and step 6's save commits."""
    from tests.dist.ckpt_faults import train_through_outage
    from tests.dist.test_checkpoint_faults import small

    monkeypatch.setenv("GOODPUT_S3_RETRY_BUDGET_S", "2")
    s3_server.proxy.fail_next_writes(2)
    s3_server.proxy.refuse_writes_matching(r"step-00000004/")
    uri = f"s3://{bucket}/runs"
    results = run_ranks(train_through_outage, 2, config=config_to_dict(small()), uri=uri)
    assert [r[0] for r in results] == [6, 6], "training went on to the last step"
    events = results[0][1]
    committed = [d["step"] for k, d in events if k == "checkpoint_committed"]
    failed = [d["step"] for k, d in events if k == "checkpoint_failed"]
    assert committed == [2, 6] and failed == [4]
    assert committed_steps(open_store(uri), "outage") == [2, 6]


def test_shards_staged_by_a_rank_killed_mid_save_are_removed_by_the_next(bucket: str, tmp_path: Path) -> None:
    """Shards on their way to S3 wait in a local staging folder. A rank that dies mid-save (rank 1, after
    its upload, before its marker) leaves its staged shard there; the next process to stage on the host
    removes it, and a rank that ends normally leaves nothing (checkpointing/staging.py)."""
    from tests.dist.ckpt_faults import die_mid_save, resave_committed_step
    from tests.dist.test_checkpoint_faults import small

    uri, staging = f"s3://{bucket}/staged", tmp_path / "staging"
    results = run_ranks(die_mid_save, 2, may_die=frozenset({1}), config=config_to_dict(small()), root=str(tmp_path),
                        uri=uri)
    assert results[1] is None, "rank 1 was meant to die"
    assert committed_steps(open_store(uri), "crash") == [2]
    left = sorted(p.relative_to(staging) for p in staging.rglob("*.distcp"))
    assert [p.name for p in left] == ["__1_0.distcp"] and left[0].parts[0].startswith("crash-a0-r1-"), left
    run_ranks(resave_committed_step, 2, config=config_to_dict(small()), root=str(tmp_path), uri=uri)
    assert committed_steps(open_store(uri), "resave") == [2]
    assert list(staging.iterdir()) == [], "the killed rank's shard was swept, and the others closed their own"


def test_a_dataset_tokenized_to_s3_reads_back_as_the_same_windows(bucket: str, tmp_path: Path) -> None:
    """`goodput tokenize --out s3://...` writes what a run's ShardSource reads from the store: the same
    windows, sample by sample, as the same text tokenized to a local folder."""
    from tests.support.text import train_tokenizer
    from tests.unit.test_tokenize import TEXTS, _files

    from trainer.shards import DatasetManifest, ShardSource
    from trainer.tokenize import tokenize

    train_tokenizer(TEXTS * 20, tmp_path / "tokenizer.json")
    files = _files(tmp_path / "in")
    on_s3, local = f"s3://{bucket}/datasets/mine", f"file://{tmp_path / 'local'}"
    written = tokenize(files, tmp_path / "tokenizer.json", on_s3, field_name="body", shard_tokens=40)
    tokenize(files, tmp_path / "tokenizer.json", local, field_name="body", shard_tokens=40)
    assert len(written.shards) > 1 and DatasetManifest.read(open_store(on_s3)).tokens == written.tokens
    ids = [0, 5, 11, 40, 3]
    remote = ShardSource([(on_s3, 1.0)], seed=2, seq_len=8, vocab_size=300).batch(ids)
    assert (remote == ShardSource([(local, 1.0)], seed=2, seq_len=8, vocab_size=300).batch(ids)).all()
