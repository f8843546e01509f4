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
from trainer.config import (
    DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_to_dict, state_fingerprint,
)

pytestmark = pytest.mark.dist

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


def _config(dp: int, steps: int) -> TrainerConfig:
    return TrainerConfig(model=MODEL, data=DataConfig(seed=4),
                         train=TrainConfig(steps=steps, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32"),
                         mesh=MeshShape(dp=dp, pp=2, tp=1))


def train(*, rank: int, world_size: int, store_port: int, config: dict, prefix: str, attempt: int,
          nodes: list[str], root: str, every: int = 1, restore: dict | None = None, uri: str | None = None,
          resume_step: int | None = None) -> dict:
    """One attempt of run 'p'; rank r's node is nodes[r] (its snapshots in root/nodes[r])."""
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
    run_worker(WorkerArgs(
        rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port, store_prefix=prefix,
        config=cfg, attempt=attempt, run_id="p", peer_every=every, peer_buddy=tuple(buddy) if buddy else None,
        peer_dir=f"{root}/{nodes[rank]}", peer_restore=PeerPoint(**restore) if restore else None,
        checkpoint_uri=uri, checkpoint_every=2 if uri else 0, resume_step=resume_step,
        staging_dir=f"{root}/staging"), sink, at_end)
    out["events"] = sink.events
    out["reports"] = sink.reports
    return out


def _point(root: Path, nodes: list[str]) -> dict:
    held = {node: holdings(held_copies(root / node / "p")) for node in set(nodes)}
    point, why = peer_point(held, identity=state_fingerprint(MODEL), nodes=set(nodes))
    assert point is not None, why
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
    # The new attempt's snapshots replaced the old ones: every node holds attempt 1's step 4 only.
    for node in ("n0", "n2"):
        copies = held_copies(root / node / "p")
        assert {(c.attempt, c.step) for c in copies} == {(1, 4)}, copies
        assert sorted((c.rank, c.role) for c in copies) == (
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
