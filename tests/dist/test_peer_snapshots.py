"""Peer snapshots through the real worker entry point, on "nodes" that are folders (a node's host memory):
a run interrupted after its snapshot of step 2 loses a node, and the next attempt loads step 2 from
the copies the surviving node and the spare hold, reading nothing from the object store:
- on the same mesh (the lost node's ranks on a spare) it ends bit-identical to an uninterrupted run;
- on a shrunk mesh (dp2 -> dp1) it trains on exactly as from the store's step-2 checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from checkpointing.peer import buddies, held_copies, holdings, peer_point
from tests.dist.harness import run_ranks
from trainer.peer import PHASES
from trainer.config import (
    DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_to_dict, state_fingerprint,
)

pytestmark = pytest.mark.dist

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


def _config(dp: int, steps: int) -> TrainerConfig:
    return TrainerConfig(model=MODEL, data=DataConfig(seed=4),
                         train=TrainConfig(steps=steps, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32",
                                           warmup_steps=3, grad_clip=0.5),
                         mesh=MeshShape(dp=dp, pp=2, tp=1))


def train(*, rank: int, world_size: int, store_port: int, config: dict, prefix: str, attempt: int,
          nodes: list[str], root: str, every: int = 1, restore: dict | None = None, uri: str | None = None,
          resume_step: int | None = None, may_fail: bool = False) -> dict:
    """One attempt of run 'p'; rank r's node is nodes[r] (its snapshots in root/nodes[r]). `may_fail`:
    an attempt that fails returns its events and error instead of raising."""
    from checkpointing.peer import PeerPoint
    from tests.dist.reshard import full_state
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    out: dict = {}

    def at_end(trainer, report) -> None:  # type: ignore[no-untyped-def]
        if trainer.step == cfg.train.steps:
            out["state"] = full_state(trainer)

    buddy = buddies(nodes, {n: n for n in nodes})
    sink = ListSink()
    try:
        run_worker(WorkerArgs(
            rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port, store_prefix=prefix,
            config=cfg, attempt=attempt, run_id="p", peer_every=every, peer_buddy=tuple(buddy) if buddy else None,
            peer_dir=f"{root}/{nodes[rank]}", peer_restore=PeerPoint(**restore) if restore else None,
            checkpoint_uri=uri, checkpoint_every=2 if uri else 0, resume_step=resume_step,
            staging_dir=f"{root}/staging"), sink, at_end)
    except Exception as e:
        if not may_fail:
            raise
        out["error"] = f"{type(e).__name__}: {e}"
    out["events"] = sink.events
    out["reports"] = sink.reports
    return out


def lose_node_at(*, rank: int, world_size: int, store_port: int, config: dict, root: str, nodes: list[str],
                 dying: str, phase: str, step: int) -> dict:
    """Attempt 0 of run 'p' in which node `dying` is lost at `phase` of step `step`'s snapshot exchange:
    the first of its ranks to get there SIGKILLs every process of the node (their PIDs are in
    root/pids), itself last, as a machine that dies ends them all at once. A survivor returns the
    steps it reported (what the controller heard of) once its attempt fails."""
    import os
    import signal

    from trainer.config import config_from_dict
    from trainer.peer import PeerSnapshots
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    pids = Path(root) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / str(rank)).write_text(str(os.getpid()))
    PeerSnapshots.chunk_bytes = 4096  # many chunks: "mid-send" is between two of them

    def lose_the_node(at: str, at_step: int) -> None:
        if nodes[rank] != dying or (at, at_step) != (phase, step):
            return
        for other in (r for r, node in enumerate(nodes) if node == dying and r != rank):
            os.kill(int((pids / str(other)).read_text()), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    buddy = buddies(nodes, {n: n for n in nodes})
    sink = ListSink()
    try:
        run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port,
                              store_prefix="lost", config=config_from_dict(config), run_id="p", peer_every=1,
                              peer_buddy=tuple(buddy) if buddy else None, peer_dir=f"{root}/{nodes[rank]}",
                              collective_timeout_s=30), sink, on_snapshot_phase=lose_the_node)
    except Exception as e:  # noqa: BLE001 - a survivor: its peers are gone
        return {"reported": [r.step for r in sink.reports], "error": f"{type(e).__name__}: {e}"}
    return {"reported": [r.step for r in sink.reports], "error": None}


def _point(root: Path, nodes: list[str]) -> dict:
    held = {node: holdings(held_copies(root / node / "p")) for node in set(nodes)}
    point, why = peer_point(held, identity=state_fingerprint(MODEL), nodes=set(nodes))
    held_by = {n: sorted((c.step, c.rank, c.role, c.slot) for c in held_copies(root / n / "p")) for n in set(nodes)}
    assert point is not None, (why, held_by)
    return point.__dict__


def test_a_lost_node_heals_from_peers_bit_identical(tmp_path: Path) -> None:
    nodes = ["n0", "n0", "n1", "n1"]  # dp2 x pp2: each dp replica on a node; buddies on the other
    straight = run_ranks(train, 4, config=config_to_dict(_config(2, 4)), prefix="s", attempt=0, nodes=nodes,
                         root=str(tmp_path / "straight"))
    root = tmp_path / "healed"
    run_ranks(train, 4, config=config_to_dict(_config(2, 2)), prefix="a", attempt=0, nodes=nodes, root=str(root))
    shutil.rmtree(root / "n1")  # the node is lost, with its host memory
    after = ["n0", "n0", "n2", "n2"]  # its ranks on a spare
    point = _point(root, after)
    assert (point["step"], point["cursor"], point["attempt"]) == (2, 16, 0)
    # The reports of the step ride with the copies (the last stage's ranks, 1 and 3, know the loss):
    # rank 3's come from the copy n0 kept for it, sent with its bytes.
    copies = {(c.rank, c.role): c for c in held_copies(root / "n0" / "p") if c.step == 2}
    assert [(r["rank"], r["step"]) for r in copies[3, "buddy"].reports] == [(3, 2)]
    assert [(r["rank"], r["step"]) for r in copies[1, "own"].reports] == [(1, 2)]
    assert copies[0, "own"].reports == [] and copies[2, "buddy"].reports == []
    healed = run_ranks(train, 4, config=config_to_dict(_config(2, 4)), prefix="b", attempt=1, nodes=after,
                       root=str(root), restore=point)
    for a, b in zip(straight, healed):
        assert set(a["state"]) == set(b["state"])
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), f"{name} differs after healing from peers"
        (restored,) = [d for kind, d in b["events"] if kind == "restored"]
        assert restored["source"] == "peer" and restored["step"] == 2 and restored["bytes_read"] == 0
        assert restored["how"] == "same mesh"
        assert restored["bytes_from_peers"] > 0  # the lost node's shards came from their buddies
        assert not [d for kind, d in b["events"] if kind == "peer_snapshot_failed"]
        assert [r.step for r in b["reports"]] == [3, 4]
    # The new attempt's snapshots replaced the old ones: every node holds attempt 1's steps 3 and 4,
    # one in each slot.
    for node in ("n0", "n2"):
        copies = held_copies(root / node / "p")
        assert {(c.attempt, c.step, c.slot) for c in copies} == {(1, 3, 0), (1, 4, 1)}, copies
        assert sorted((c.rank, c.role) for c in copies if c.step == 4) == (
            [(0, "own"), (1, "own"), (2, "buddy"), (3, "buddy")] if node == "n0"
            else [(0, "buddy"), (1, "buddy"), (2, "own"), (3, "own")])


def test_a_shrunk_mesh_loads_the_peers_state(tmp_path: Path) -> None:
    nodes = ["n0", "n0", "n1", "n1"]
    root = tmp_path / "peers"
    uri = f"file://{tmp_path / 'store'}"
    run_ranks(train, 4, config=config_to_dict(_config(2, 2)), prefix="a", attempt=0, nodes=nodes, root=str(root),
              uri=uri)
    shutil.rmtree(root / "n0")  # dp replica 0's node is lost; dp1 goes on alone on n1
    point = _point(root, ["n1", "n1"])
    # One step on from step 2 on dp1, loaded from the peers' copies and from the store's checkpoint.
    from_peers = run_ranks(train, 2, config=config_to_dict(_config(1, 3)), prefix="b", attempt=1,
                           nodes=["n1", "n1"], root=str(root), restore=point, every=0)
    from_store = run_ranks(train, 2, config=config_to_dict(_config(1, 3)), prefix="c", attempt=1,
                           nodes=["n1", "n1"], root=str(tmp_path / "unused"), uri=uri, resume_step=2, every=0)
    for p, s in zip(from_peers, from_store):
        assert set(p["state"]) == set(s["state"]) and s["state"]
        for name, value in s["state"].items():
            assert torch.equal(value, p["state"][name]), f"{name}: the peers' state differs from the store's"
        (restored,) = [d for kind, d in p["events"] if kind == "restored"]
        assert restored["source"] == "peer" and restored["saved_on_mesh"] == {"dp": 2, "pp": 2, "tp": 1}
        assert restored["how"] == "resharded"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Five steps of run 'p' with no failure: what every healed run must end with."""
    root = tmp_path_factory.mktemp("straight")
    return run_ranks(train, 4, config=config_to_dict(_config(2, 5)), prefix="s", attempt=0,
                     nodes=["n0", "n0", "n1", "n1"], root=str(root))


@pytest.mark.parametrize("phase", PHASES)
def test_a_node_lost_at_any_phase_of_the_exchange_heals_from_peers(tmp_path: Path, phase: str,
                                                                    uninterrupted: list[dict]) -> None:
    """Node n1 dies at `phase` of step 3's snapshot exchange. Whatever the phase, the surviving node
    and a spare hold a whole step the new attempt loads from peers (step 3 once its exchange was
    through, else step 2, still whole in the other slot), never older than any step a survivor
    reported, and the healed run ends bit-identical to the uninterrupted one."""
    nodes = ["n0", "n0", "n1", "n1"]
    lost = run_ranks(lose_node_at, 4, may_die=frozenset({2, 3}), config=config_to_dict(_config(2, 5)),
                     root=str(tmp_path), nodes=nodes, dying="n1", phase=phase, step=3)
    assert lost[2] is None and lost[3] is None, "the node's ranks were to die with it"
    survivors = [r for r in lost if r is not None]
    assert all(r["error"] for r in survivors), survivors  # the attempt failed on the surviving node too
    heard = max(step for r in survivors for step in r["reported"])
    shutil.rmtree(tmp_path / "n1")  # the node's host memory is gone with it
    after = ["n0", "n0", "n2", "n2"]
    point = _point(tmp_path, after)
    assert point["step"] in (2, 3) and point["step"] >= heard, (point, heard, survivors)
    if phase == "released":
        assert point["step"] == 3  # the survivors may have heard of it: it must be whole
    # Whether or not a survivor's report of it got out, the step loaded brings its report, as run.
    losses = {r.step: r.loss for r in uninterrupted[1]["reports"]}
    assert [(r["step"], r["loss"]) for r in point["reports"]] == [(point["step"], losses[point["step"]])]
    healed = run_ranks(train, 4, config=config_to_dict(_config(2, 5)), prefix="b", attempt=1, nodes=after,
                       root=str(tmp_path), restore=point)
    for a, b in zip(uninterrupted, healed):
        (restored,) = [d for kind, d in b["events"] if kind == "restored"]
        assert restored["source"] == "peer" and restored["step"] == point["step"], restored
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), f"{name} differs after healing from peers at {phase}"


def _flip_a_byte(root: Path, node: str, rank: int, role: str, step: int) -> str:
    (copy,) = [c for c in held_copies(root / node / "p") if (c.rank, c.role, c.step) == (rank, role, step)]
    path = root / node / "p" / copy.stem
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(data)
    return copy.stem


def test_a_damaged_copy_is_never_loaded_the_other_copy_is(tmp_path: Path, uninterrupted: list[dict]) -> None:
    """Rank 0's own copy of step 3 rots in n0's memory (one byte) before every rank restarts on the same
    nodes: rank 0's state comes from the copy n1 keeps for it, and the run ends bit-identical."""
    nodes = ["n0", "n0", "n1", "n1"]
    run_ranks(train, 4, config=config_to_dict(_config(2, 3)), prefix="a", attempt=0, nodes=nodes, root=str(tmp_path))
    stem = _flip_a_byte(tmp_path, "n0", 0, "own", 3)
    point = _point(tmp_path, nodes)
    assert point["step"] == 3  # the marker alone does not tell: the checksum does, at load
    healed = run_ranks(train, 4, config=config_to_dict(_config(2, 5)), prefix="b", attempt=1, nodes=nodes,
                       root=str(tmp_path), restore=point)
    assert not (tmp_path / "n0" / "p" / f"{stem}.json").exists(), "the damaged copy is still offered"
    for a, b in zip(uninterrupted, healed):
        (restored,) = [d for kind, d in b["events"] if kind == "restored"]
        assert restored["source"] == "peer" and restored["step"] == 3
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), f"{name} differs: the damaged copy was loaded"
    (rank0,) = [d for kind, d in healed[0]["events"] if kind == "restored"]
    assert rank0["bytes_from_peers"] > 0  # rank 0's state came from the copy n1 keeps


def test_a_step_whose_only_copy_is_damaged_fails_its_load_and_says_so(tmp_path: Path) -> None:
    """n1 is lost and the copy n0 keeps of rank 2 rots: no intact copy of rank 2's state is left, so
    every rank fails the load and rank 0 reports restore_failed (the controller then never picks
    that step again: tests/unit/test_state_machine.py)."""
    nodes = ["n0", "n0", "n1", "n1"]
    run_ranks(train, 4, config=config_to_dict(_config(2, 3)), prefix="a", attempt=0, nodes=nodes, root=str(tmp_path))
    shutil.rmtree(tmp_path / "n1")
    stem = _flip_a_byte(tmp_path, "n0", 2, "buddy", 3)
    after = ["n0", "n0", "n2", "n2"]
    point = _point(tmp_path, after)
    failed = run_ranks(train, 4, config=config_to_dict(_config(2, 5)), prefix="b", attempt=1, nodes=after,
                       root=str(tmp_path), restore=point, may_fail=True)
    assert all("CheckpointError" in r["error"] for r in failed), [r.get("error") for r in failed]
    (report,) = [d for kind, d in failed[0]["events"] if kind == "restore_failed"]
    assert report["source"] == "peer" and (report["saved_by_attempt"], report["step"]) == (0, 3), report
    assert "[2]" in report["error"] and stem in report["error"], report
    assert not [d for r in failed[1:] for kind, d in r["events"] if kind == "restore_failed"]  # said once


def train_replicas(*, rank: int, world_size: int, store_port: int, config: dict, prefix: str, attempt: int,
                   nodes: list[str], root: str, restore: dict | None = None, loaders: tuple[int, ...] | None = None) -> dict:
    """One attempt of run 'p' under failure_domain replica (each replica its own world; the test
    published epoch 0 under `prefix`): snapshots every step within each replica; `restore`: the peer
    step the replicas in `loaders` load (the others join at epoch 0 and receive it)."""
    from checkpointing.peer import PeerPoint, replica_buddies
    from tests.dist.reshard import full_state
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    out: dict = {}

    def at_end(trainer, report) -> None:  # type: ignore[no-untyped-def]
        if trainer.step == cfg.train.steps:
            out["state"] = full_state(trainer)

    buddy = replica_buddies(nodes, {n: n for n in nodes}, cfg.mesh.dp_replicas)
    per = world_size // cfg.mesh.dp_replicas
    loads = restore is not None and (loaders is None or rank // per in loaders)
    sink = ListSink()
    run_worker(WorkerArgs(
        rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port, store_prefix=prefix,
        config=cfg, attempt=attempt, run_id="p", peer_every=1, peer_buddy=tuple(buddy) if buddy else None,
        peer_dir=f"{root}/{nodes[rank]}", peer_restore=PeerPoint(**restore) if loads else None,
        replica_domain=True, collective_timeout_s=30), sink, at_end)
    out["events"] = sink.events
    return out


def _replicas_attempt(config: TrainerConfig, prefix: str, attempt: int, nodes: list[str], root: Path,
                      joining: tuple[int, ...] = (), **kwargs: object) -> list[dict]:
    """Publish epoch 0 (as the controller does before a launch) and run the attempt's ranks."""
    import torch.distributed as dist

    from tests.dist.harness import Ranks
    from trainer.replica import Membership, MembershipBoard

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    MembershipBoard(dist.PrefixStore(prefix, store)).publish(
        Membership(0, tuple(range(config.mesh.dp_replicas)), joining))
    try:
        return Ranks(train_replicas, config.mesh.world_size, port=store.port, config=config_to_dict(config),
                     prefix=prefix, attempt=attempt, nodes=nodes, root=str(root), **kwargs).collect(300)
    finally:
        del store


def test_replicas_snapshot_inside_themselves_and_one_whole_replica_restores_the_run(tmp_path: Path) -> None:
    """failure_domain replica, dp2 as two replicas of pp2, one rank per "node": each replica's ranks
    keep each other's copies (named by local rank). Both of replica 1's nodes are lost after step 2;
    the next attempt places replica 1 on two spares: replica 0 loads step 2 from its own nodes' memory,
    replica 1 holds nothing, joins at epoch 0 and receives replica 0's state. Both end bit-identical
    to an uninterrupted run of 4 steps."""
    from checkpointing.peer import replica_peer_point

    def config(steps: int) -> TrainerConfig:
        c = _config(2, steps)
        return TrainerConfig(model=c.model, data=c.data, train=c.train, mesh=MeshShape(dp=2, pp=2, tp=1, dp_replicas=2))

    nodes = ["n0", "n1", "n2", "n3"]
    straight = _replicas_attempt(config(4), "s/", 0, nodes, tmp_path / "straight")
    root = tmp_path / "healed"
    _replicas_attempt(config(2), "a/", 0, nodes, root)
    held_by = {n: sorted((c.rank, c.role, c.step, c.world_size) for c in held_copies(root / n / "p")) for n in nodes}
    assert held_by["n0"] == [(0, "own", 1, 2), (0, "own", 2, 2), (1, "buddy", 1, 2), (1, "buddy", 2, 2)], held_by
    assert held_by["n2"] == held_by["n0"], "each replica keeps its own copies, named by local rank"
    shutil.rmtree(root / "n2")
    shutil.rmtree(root / "n3")
    after = ["n0", "n1", "n4", "n5"]
    held = {node: holdings(held_copies(root / node / "p")) for node in set(after)}
    point, loaders, why = replica_peer_point(held, identity=state_fingerprint(MODEL),
                                             replica_nodes=[set(after[:2]), set(after[2:])])
    assert point is not None and loaders == (0,), why
    assert (point.step, point.world_size, point.mesh) == (2, 2, {"dp": 1, "pp": 2, "tp": 1})
    healed = _replicas_attempt(config(4), "b/", 1, after, root, joining=(1,), restore=point.__dict__, loaders=loaders)
    for rank, (a, b) in enumerate(zip(straight, healed)):
        assert set(a["state"]) == set(b["state"])
        for name, value in a["state"].items():
            assert torch.equal(value, b["state"][name]), f"rank {rank}: {name} differs after healing from peers"
        (restored,) = [d for kind, d in b["events"] if kind == "restored"]
        if rank < 2:
            assert restored["source"] == "peer" and restored["step"] == 2 and restored["how"] == "same mesh"
        else:
            assert restored["source"] == "replica" and restored["replica"] == 0 and restored["step"] == 2, restored
