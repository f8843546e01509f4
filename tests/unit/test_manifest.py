"""The commit protocol over an object store: no manifest, no step; a corrupted or missing file makes
a step unusable and the previous one is used; a step commits once; retention keeps the newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from checkpointing.manifest import (
    CheckpointError, Manifest, apply_retention, commit, committed_steps, describe, latest_verified,
    step_prefix, wait_for_ranks, write_rank_marker,
)
from checkpointing.store import LocalStore
from controller.run_state import RunState
from controller.spec import parse_spec
from controller.state import RunController
from tests.unit.fakes import FakeWorkerGroup

ROOT = Path(__file__).resolve().parents[2]


def write_step(store: LocalStore, step: int, *, committed: bool = True, ranks: int = 2) -> Path:
    prefix = step_prefix("run", step)
    directory = store.root / prefix
    directory.mkdir(parents=True)
    files = {}
    for rank in range(ranks):
        path = directory / f"__{rank}_0.distcp"
        path.write_bytes(bytes(range(256)) * (step + rank + 1))
        files[path.name] = path
    (directory / ".metadata").write_bytes(b"meta")
    files[".metadata"] = directory / ".metadata"
    if committed:
        commit(store, Manifest(run_id="run", step=step, attempt=0, mesh={"dp": ranks, "pp": 1, "tp": 1},
                               world_size=ranks, cursor=step * 4, seeds={"data": 0, "init": 0},
                               files=describe(files)))
    return directory


def test_uncommitted_step_is_invisible(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_step(store, 10)
    write_step(store, 20, committed=False)
    assert committed_steps(store, "run") == [10]
    found = latest_verified(store, "run")
    assert found is not None and found[0].step == 10


def test_flipped_byte_falls_back_to_previous(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_step(store, 10)
    d = write_step(store, 20)
    data = bytearray((d / "__1_0.distcp").read_bytes())
    data[100] ^= 0x01
    (d / "__1_0.distcp").write_bytes(bytes(data))
    found = latest_verified(store, "run")
    assert found is not None
    manifest, skipped = found
    assert manifest.step == 10
    assert len(skipped) == 1 and "__1_0.distcp fails its sha256 check" in skipped[0]


def test_missing_file_falls_back(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_step(store, 10)
    (write_step(store, 20) / ".metadata").unlink()
    found = latest_verified(store, "run")
    assert found is not None and found[0].step == 10 and ".metadata is missing" in found[1][0]


def test_a_step_commits_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_step(store, 10)
    with pytest.raises(CheckpointError, match="step 10 of run is already committed"):
        commit(store, Manifest(run_id="run", step=10, attempt=1, mesh={}, world_size=1, cursor=0, seeds={}))


def test_commit_waits_for_every_rank(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    prefix = step_prefix("run", 5)
    write_rank_marker(store, prefix, 0, {"a": {"size": 1, "sha256": "x"}}, attempt=0, world_size=2)
    with pytest.raises(CheckpointError, match="only 1 of 2 ranks of attempt 0 finished writing"):
        wait_for_ranks(store, prefix, 2, attempt=0, timeout_s=0.3, poll_s=0.05)
    write_rank_marker(store, prefix, 1, {"b": {"size": 2, "sha256": "y"}}, attempt=0, world_size=2)
    assert set(wait_for_ranks(store, prefix, 2, attempt=0, timeout_s=1)) == {"a", "b"}


def test_a_commit_never_mixes_attempts(tmp_path: Path) -> None:
    """A crashed save of attempt 0 on 4 ranks left markers of ranks 0-3 at step 10; attempt 1 on 2
    ranks saves step 10 again: its commit lists its own two ranks' files and nothing of attempt 0's."""
    store = LocalStore(tmp_path)
    prefix = step_prefix("run", 10)
    for rank in range(4):
        write_rank_marker(store, prefix, rank, {f"__{rank}_0.distcp": {"size": 9, "sha256": f"old{rank}"}},
                          attempt=0, world_size=4)
    with pytest.raises(CheckpointError, match="only 0 of 2 ranks of attempt 1"):
        wait_for_ranks(store, prefix, 2, attempt=1, timeout_s=0.2, poll_s=0.05)
    for rank in range(2):
        write_rank_marker(store, prefix, rank, {f"__{rank}_0.distcp": {"size": 5, "sha256": f"new{rank}"}},
                          attempt=1, world_size=2)
    files = wait_for_ranks(store, prefix, 2, attempt=1, timeout_s=1)
    assert files == {"__0_0.distcp": {"size": 5, "sha256": "new0"}, "__1_0.distcp": {"size": 5, "sha256": "new1"}}


def test_a_marker_that_claims_another_attempt_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    prefix = step_prefix("run", 10)
    write_rank_marker(store, prefix, 0, {"a": {"size": 1, "sha256": "x"}}, attempt=2, world_size=1)
    key = f"{prefix}/_ranks/attempt-2-world-1/rank-0.json"
    store.put_bytes(key, store.get_bytes(key).replace(b'"attempt": 2', b'"attempt": 1'))
    with pytest.raises(CheckpointError, match="says rank 0 of attempt 1"):
        wait_for_ranks(store, prefix, 1, attempt=2, timeout_s=1)


def test_retention_keeps_newest(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for step in (10, 20, 30, 40):
        write_step(store, step)
    write_step(store, 35, committed=False)
    assert apply_retention(store, "run", keep=2) == [10, 20]
    assert committed_steps(store, "run") == [30, 40]
    assert not (tmp_path / step_prefix("run", 35)).exists()


def test_controller_resumes_from_latest_verified(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    write_step(store, 10)
    d = write_step(store, 20)
    (d / "__0_0.distcp").write_bytes(b"torn")
    spec = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run"})
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    while c.state is not RunState.RUNNING:
        c.step(1.0)
    attempt = group.started[0]
    assert attempt.start_step == 10 and attempt.cursor == 40 and attempt.resume_step == 10
    unusable = c.events.of_kind("checkpoint_unusable")
    assert len(unusable) == 1 and "step-00000020" in unusable[0].detail["reason"]


@pytest.mark.parametrize("store_down", [False, True], ids=["store answers", "store down at the failure"])
def test_a_step_a_rank_found_corrupt_is_discarded_and_the_run_resumes_before_it(tmp_path: Path,
                                                                                store_down: bool) -> None:
    """The controller no longer reads a step's bytes before loading it (a listing and the sizes); the
    loading ranks check them. When rank 0 reports `restore_failed`, the step is made invisible (its
    manifest first) before the next launch chooses, so the next attempt loads step 10, and a
    restarted service would not pick step 20 again either. A store that does not answer at the
    failure owes the discard until the next launch."""
    from tests.unit.fakes import FlakyStore

    inner = LocalStore(tmp_path)
    store = FlakyStore(inner)
    write_step(inner, 10)
    d = write_step(inner, 20)
    data = bytearray((d / "__1_0.distcp").read_bytes())
    data[100] ^= 0x01  # same size: the controller's listing cannot tell
    (d / "__1_0.distcp").write_bytes(bytes(data))
    spec = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run"})
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    t = 0.0
    while c.state is not RunState.RUNNING:
        t += 1
        c.step(t)
    assert group.started[0].resume_step == 20
    error = "run/step-00000020/__1_0.distcp read from file://...: the 256 bytes at 0 fail their sha256 check"
    group.emit(0, "restore_failed", step=20, error=error)
    for rank in range(8):
        group.error_worker(rank, f"CheckpointError: {error}")
    store.down = store_down
    c.step(t + 1)
    c.step(t + 5)  # past the attribution grace
    assert c.state is RunState.LAUNCHING
    assert committed_steps(inner, "run") == ([10, 20] if store_down else [10])
    store.down = False
    while c.state is not RunState.RUNNING:
        t += 1
        c.step(t + 5)
    assert group.started[-1].resume_step == 10 and group.started[-1].cursor == 40
    assert committed_steps(inner, "run") == [10] and not d.exists()
    (discarded,) = c.events.of_kind("checkpoint_discarded")
    assert discarded.detail["step"] == 20 and "found it corrupt" in discarded.detail["reason"]
    assert "fail their sha256 check" in discarded.detail["reason"]


class PeerHoldingGroup(FakeWorkerGroup):
    """A fake group whose nodes say they hold `held` (checkpointing.peer.Held records) of the run's
    peer snapshots; it notes the folder key each question named."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, list] = {}
        self.asked: list[str] = []

    def peer_copies(self, peer_key: str, nodes: set[str]) -> dict[str, list]:
        self.asked.append(peer_key)
        return {node: held for node, held in self.held.items() if node in nodes}


def _running_from_store_step_20(tmp_path: Path) -> tuple[Any, PeerHoldingGroup, RunController, LocalStore, float]:
    """A tiny-gpt run named 'run' whose store holds step 20, stepped until its first attempt runs:
    (spec, group, controller, store, the time reached)."""
    store = LocalStore(tmp_path)
    write_step(store, 20)
    spec = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run"})
    group = PeerHoldingGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    t = 0.0
    while c.state is not RunState.RUNNING:
        t += 1
        c.step(t)
    return spec, group, c, store, t


def test_a_peer_load_that_fails_is_never_tried_again_the_store_is(tmp_path: Path) -> None:
    """Every node says it holds attempt 0's snapshot of step 26, so attempt 1 loads it from peers;
    its ranks fail the load (a copy failed its checksum) and rank 0 says so (`restore_failed`, source
    peer). The next attempt does not pick the same step again (until max_failures, as before): it
    loads the store's step 20, and the timeline says why."""
    from checkpointing.peer import Held
    from trainer.config import state_fingerprint

    spec, group, c, store, t = _running_from_store_step_20(tmp_path)
    assert group.started[0].resume_step == 20 and group.started[0].peer_restore is None
    group.finish_steps(21, 26)
    held = Held(attempt=0, step=26, cursor=26 * 16, world_size=8, mesh={"dp": 2, "pp": 2, "tp": 2},
                identity=state_fingerprint(spec.to_model_config()), ranks=tuple(range(8)))
    group.held = {node.name: [held] for node in spec.topology().nodes}
    group.error_worker(3, "RuntimeError: the rank failed")

    def relaunch() -> None:
        nonlocal t
        c.step(t + 1)
        c.step(t + 5)  # past the attribution grace
        t += 5
        while c.state is not RunState.RUNNING:
            t += 1
            c.step(t)

    relaunch()
    peer = group.started[-1].peer_restore
    assert peer is not None and (peer.attempt, peer.step) == (0, 26)
    error = "peer snapshot of step 26 (attempt 0): no node of this attempt holds an intact copy of old rank(s) [2]"
    group.emit(0, "restore_failed", source="peer", saved_by_attempt=0, step=26, error=error)
    for rank in range(8):
        group.error_worker(rank, f"CheckpointError: {error}")
    relaunch()
    last = group.started[-1]
    assert last.peer_restore is None and last.resume_step == 20 and last.start_step == 20, last
    (unusable,) = [e.detail for e in c.events.of_kind("checkpoint_unusable") if e.detail.get("source") == "peer"]
    assert unusable["step"] == 26 and "intact copy" in unusable["reason"]
    assert committed_steps(store, "run") == [20], "a peer snapshot's failure is not the store's"
    # Every question about snapshots named this run's own folder, which another run of the same name has not.
    assert set(group.asked) == {c.checkpoints.peer_key} and {a.peer_key for a in group.started} == set(group.asked)
    other = RunController(spec, spec.topology(), PeerHoldingGroup(), now=1.0, checkpoint_store=store)
    assert other.checkpoints.peer_key != c.checkpoints.peer_key and c.checkpoints.peer_key.startswith("run-")


def test_the_steps_a_loaded_snapshot_ran_but_the_controller_never_heard_of_are_kept(tmp_path: Path) -> None:
    """Attempt 0 was heard of through step 25; its ranks finished 26 and 27 too, and step 27 is whole on
    the peers, but those two reports died with the rank that sent them. Attempt 1 loads step 27 from
    peers, and the record of kept steps has no hole: 26 and 27 as attempt 0 ran them (the markers'
    reports), then attempt 1's steps; the timeline says which steps came from the snapshot."""
    from checkpointing.peer import Held
    from trainer.config import state_fingerprint

    spec, group, c, store, t = _running_from_store_step_20(tmp_path)
    group.finish_steps(21, 25)
    c.step(t + 0.5)
    assert [h["step"] for h in c.progress.history] == [21, 22, 23, 24, 25]
    unheard = [{"rank": 7, "attempt": 0, "step": s, "cursor": s * 16, "loss": 9.0 - s / 10, "step_time_s": 0.5,
                "data_s": 0.0, "compute_s": 0.4, "wait_s": 0.1, "tokens_per_s": 100.0, "end_time": 100.0 + s,
                "a_field_of_a_newer_version": 1} for s in (24, 25, 26, 27)]
    held = Held(attempt=0, step=27, cursor=27 * 16, world_size=8, mesh={"dp": 2, "pp": 2, "tp": 2},
                identity=state_fingerprint(spec.to_model_config()), ranks=tuple(range(8)), reports=tuple(unheard))
    group.held = {node.name: [held] for node in spec.topology().nodes}
    group.error_worker(3, "RuntimeError: the rank failed")
    c.step(t + 1)
    c.step(t + 5)  # past the attribution grace
    t += 5
    while c.state is not RunState.RUNNING:
        t += 1
        c.step(t)
    assert group.started[-1].peer_restore is not None and group.started[-1].start_step == 27
    (started,) = [e.detail for e in c.events.of_kind("attempt_started") if e.attempt == 1]
    assert started["reports_from_snapshot"] == [26, 27]
    history = c.progress.history
    assert [(h["step"], h["attempt"]) for h in history] == [(s, 0) for s in range(21, 28)]
    assert history[-1]["loss"] == 9.0 - 2.7 and history[-1]["end"] == 127.0
    group.finish_steps(28, 29)
    c.step(t + 1)
    assert [(h["step"], h["attempt"]) for h in c.progress.history][-3:] == [(27, 0), (28, 1), (29, 1)]


def test_a_run_whose_final_save_failed_is_not_done_until_it_is_saved(tmp_path: Path) -> None:
    """Every rank finished, but the store refused the last step's save past the retry budget (a chaos
    soak's storage outage over the end of a run): the run does not end `succeeded` with its final
    state lost. It trains again from the last committed step and ends once step 20 commits."""
    store = LocalStore(tmp_path)
    raw = {**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run"}
    spec = parse_spec({**raw, "train": {**raw["train"], "steps": 20},
                       "checkpoint": {"uri": f"file://{tmp_path}", "every_steps": 10}})
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    t = 0.0
    while c.state is not RunState.RUNNING:
        t += 1
        c.step(t)
    group.finish_steps(1, 20)
    write_step(store, 10)
    group.emit(0, "checkpoint_committed", step=10, seconds=1.0)
    group.emit(0, "checkpoint_failed", step=20, error="upload of run/step-00000020: store unavailable")
    group.complete()
    c.step(t + 1)
    assert c.state is RunState.LAUNCHING, "not succeeded: the final state is not saved"
    (failure,) = c.events.of_kind("failure_detected")
    assert failure.detail["cause"] == "final_save_failed" and "step 20" in failure.detail["message"]
    while c.state is not RunState.RUNNING:
        t += 1
        c.step(t)
    assert group.started[-1].resume_step == 10 and c.attempt == 1
    group.finish_steps(11, 20)
    write_step(store, 20)
    group.emit(0, "checkpoint_committed", step=20, seconds=1.0)
    group.complete()
    c.step(t + 1)
    assert c.state is RunState.SUCCEEDED and c.progress.step == 20


def test_checkpoints_command_lists_and_verifies(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    store = LocalStore(tmp_path)
    write_step(store, 10)
    d = write_step(store, 20)
    (d / ".metadata").write_bytes(b"META")  # same size, other bytes
    proc = subprocess.run([sys.executable, "-m", "controller", "checkpoints", "run", "--uri", f"file://{tmp_path}",
                           "--json"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[0]["verification"] == "verified" and rows[0]["mesh"] == {"dp": 2, "pp": 1, "tp": 1}
    assert rows[0]["bytes"] == sum(len(bytes(range(256))) * (10 + r + 1) for r in range(2)) + 4
    assert rows[1]["verification"].startswith("unusable:") and "sha256" in rows[1]["verification"]


def test_an_unreachable_store_is_not_a_corrupt_step(tmp_path: Path) -> None:
    """A store that does not answer raises StoreError from every read; it never turns a good step
    into a skipped one (the old code skipped step 20 and would roll back to 10)."""
    from checkpointing.manifest import read_manifest
    from checkpointing.store import StoreError
    from tests.unit.fakes import FlakyStore

    store = FlakyStore(LocalStore(tmp_path))
    write_step(store.inner, 10)
    write_step(store.inner, 20)
    store.down = True
    with pytest.raises(StoreError):
        read_manifest(store, "run", 20)
    with pytest.raises(StoreError):
        latest_verified(store, "run")
    store.down = False
    found = latest_verified(store, "run")
    assert found is not None and found[0].step == 20 and found[1] == []
    with pytest.raises(CheckpointError, match="no manifest"):
        read_manifest(store, "run", 30)


def test_controller_waits_for_an_unreachable_store(tmp_path: Path) -> None:
    """At launch the store is down: no attempt starts, the run does not fail; past the retry budget
    one store_unavailable event, retries back off; once the store answers the attempt loads step 20."""
    from tests.unit.fakes import FlakyStore

    store = FlakyStore(LocalStore(tmp_path))
    write_step(store.inner, 10)
    write_step(store.inner, 20)
    spec = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run",
                       "checkpoint": {"uri": f"file://{tmp_path}", "every_steps": 10, "retry_budget_s": 5}})
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    store.down = True
    t = 0.0
    calls_at: list[float] = []
    while t < 100:
        before = store.calls
        c.step(t)
        if store.calls > before:
            calls_at.append(t)
        t += 0.1
    assert c.state is RunState.LAUNCHING and not group.started and c.error is None
    unavailable = c.events.of_kind("store_unavailable")
    assert len(unavailable) == 1 and unavailable[0].time >= 5.0
    assert "Could not connect" in unavailable[0].detail["error"]
    gaps = [b - a for a, b in zip(calls_at, calls_at[1:])]
    assert gaps[-1] >= 29 and len(calls_at) < 15, calls_at  # backed off to 30 s, not polled every step
    store.down = False
    t = calls_at[-1] + 31
    while c.state is not RunState.RUNNING:
        c.step(t)
    assert group.started[0].resume_step == 20 and c.attempt == 0
    assert not c.events.of_kind("checkpoint_unusable")
    assert len(c.events.of_kind("store_available")) == 1


def _commit_of_model(store: LocalStore, run_id: str, step: int, d_model: int) -> None:
    from trainer.config import ModelConfig, state_fingerprint, state_identity

    model = ModelConfig(n_layers=4, d_model=d_model, n_heads=4, vocab_size=256, seq_len=128)
    commit(store, Manifest(run_id=run_id, step=step, attempt=0, mesh={"dp": 2, "pp": 2, "tp": 2}, world_size=8,
                           cursor=step * 16, seeds={"data": 0, "init": 0}, identity=state_fingerprint(model),
                           identity_detail=state_identity(model)))


def test_a_checkpoint_of_another_model_is_refused_with_what_differs(tmp_path: Path) -> None:
    """The example's model (d_model 128) over an old run's checkpoints of d_model 64 under the same
    name: the run fails with checkpoint_mismatch, naming d_model, and nothing is launched (before, the
    ranks would have died on a tensor-shape error)."""
    store = LocalStore(tmp_path)
    _commit_of_model(store, "run", 20, d_model=64)
    spec = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run"})
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    for t in range(5):
        c.step(float(t))
    assert c.state is RunState.FAILED and not group.started
    assert c.error is not None and c.error.code == "checkpoint_mismatch"
    assert "d_model 64 there, 128 here" in c.error.message and "another name or checkpoint.uri" in c.error.message


def test_a_checkpoint_of_the_same_model_resumes_whatever_the_mesh_or_the_steps(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _commit_of_model(store, "run", 20, d_model=128)
    raw = {**yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()), "name": "run",
           "parallelism": {"dp": 4, "tp": 2, "pp": 1}}
    raw["train"] = {**raw["train"], "steps": 500, "lr": 1e-3}
    spec = parse_spec(raw)
    group = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), group, now=0.0, checkpoint_store=store)
    while c.state is not RunState.RUNNING:
        c.step(1.0)
    assert group.started[0].resume_step == 20


def test_goodput_run_refuses_to_start_over_another_models_checkpoints(tmp_path: Path) -> None:
    """`goodput run` resumes its own name's checkpoints: another model's are refused before anything
    starts (goodput serve gives a submission a fresh id instead: tests/unit/test_newcomer.py)."""
    from controller.service.registry import Registry
    from controller.errors import ServiceError
    from controller.service.service import Service
    from tests.unit.fakes import FakeCluster

    store = LocalStore(tmp_path)
    _commit_of_model(store, "tiny-gpt", 20, d_model=64)
    spec = parse_spec(yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()))
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: FakeWorkerGroup(),
                      store_factory=lambda _: store, threads=False, accept_submissions=False)
    with pytest.raises(ServiceError) as refused:
        service.add(spec)
    assert refused.value.code == "checkpoint_mismatch"
    assert "d_model 64 there, 128 here" in refused.value.message
    assert service.runs() == []


def test_index_changes_names_the_commits_an_index_lacks_and_the_steps_the_store_lost(tmp_path: Path) -> None:
    """The store holds steps 10 and 20 (and 40 with an unreadable manifest); the index lists 20 and 30:
    10 is missing from the index, 30 is gone from the store, 40 is no checkpoint at all."""
    from checkpointing.manifest import index_changes, step_prefix

    store = LocalStore(tmp_path)
    for step in (10, 20, 40):
        _commit_of_model(store, "r", step, d_model=64)
    (tmp_path / step_prefix("r", 40) / "manifest.json").write_text("{not json")
    missing, gone = index_changes(store, "r", {20, 30})
    assert [m.step for m in missing] == [10] and missing[0].cursor == 160
    assert gone == [30]
