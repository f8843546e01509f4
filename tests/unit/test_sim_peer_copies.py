"""What the simulated nodes say they hold of a peer snapshot (controller/sim/group.py), against the
plain rule written per rank: every rank's copy on its own node and on its buddy's, except on nodes
whose memory was lost since the snapshot, and no buddy copies when the failure struck while they
were being rewritten."""

from __future__ import annotations

import random

import pytest

from checkpointing.peer import Copy, buddies, holdings
from checkpointing.store import MemoryStore
from controller.attempt import AttemptSpec
from controller.placement import place
from controller.sim.group import SimWorkerGroup
from controller.sim.model import CostModel
from controller.spec import parse_spec
from controller.topology import Topology
from trainer.config import MeshShape, state_fingerprint

RAW = {
    "name": "p", "model": {"n_layers": 4, "d_model": 64, "n_heads": 4, "vocab_size": 128, "seq_len": 64},
    "train": {"steps": 100, "global_batch": 8, "micro_batch": 1},
    "parallelism": {"dp": 2, "tp": 1, "pp": 1},
    "cluster": {"simulated": {"nodes": 2, "gpus_per_node": 1, "racks": 1, "spares": 0}},
}


def reference(attempt: AttemptSpec, step: int, intact: set[str], torn: bool) -> dict[str, list[Copy]]:
    mesh, node_of_rank, buddy = attempt.config.mesh, attempt.placement.node_of_rank, attempt.peer_buddy
    assert buddy is not None
    identity, cursor = state_fingerprint(attempt.config.model), step * attempt.config.train.global_batch
    held: dict[str, list[Copy]] = {}
    for rank, node in enumerate(node_of_rank):
        keepers = [(node, "own")] + ([] if torn else [(node_of_rank[buddy[rank]], "buddy")])
        for keeper, role in keepers:
            if keeper in intact:
                held.setdefault(keeper, []).append(Copy(attempt.attempt, rank, mesh.world_size, step, cursor,
                                                        mesh.axes(), identity, role, 0))
    return held


@pytest.mark.parametrize("seed", range(12))
def test_the_simulated_nodes_report_what_the_per_rank_rule_gives(seed: int) -> None:
    rng = random.Random(seed)
    gpus, tp, pp = rng.choice([(2, 1, 2), (4, 2, 2), (8, 4, 4), (8, 8, 1)])
    nodes, racks = rng.randint(4, 9), rng.randint(1, 3)
    topology = Topology.from_local(nodes=nodes, gpus_per_node=gpus, racks=racks, spares=0)
    per_pipeline = pp * tp
    mesh = MeshShape(dp=max(1, nodes * gpus // per_pipeline // rng.choice([1, 2])), pp=pp, tp=tp)
    placement = place(mesh, topology)
    spec = parse_spec({**RAW, "model": {**RAW["model"], "n_heads": 8},
                       "train": {**RAW["train"], "global_batch": mesh.dp * 4}})
    buddy = buddies(placement.node_of_rank, placement.rack_of_node)
    assert buddy is not None  # at least 4 nodes
    attempt = AttemptSpec(run_id="p", attempt=rng.randint(0, 3), config=spec.trainer_config(mesh),
                          placement=placement, peer_every=1, peer_buddy=tuple(buddy))
    cost = CostModel(step_s=1.0, checkpoint_stall_s=0.0, checkpoint_save_s=0.0, restore_s=0.0, restart_s=0.0,
                     node_loss_detection_s=1.0, collective_timeout_s=1.0)  # (what is held does not depend on it)
    group = SimWorkerGroup(lambda: 100.0, cost, MemoryStore(lambda: 100.0), total_steps=100)
    used = sorted(placement.rack_of_node)
    lost = set(rng.sample(used, rng.randint(0, min(2, len(used) - 1))))
    torn = rng.random() < 0.3
    taken = 50.0
    group.snapshot = (attempt, 7, taken, 80.0 if torn else 60.0)  # the buddy copies land at 80 or 60; struck at 70
    group.stop_at = 70.0
    earlier = rng.choice([n for n in used if n not in lost])  # lost before the snapshot: holds it all the same
    group.memory_lost = {n: 65.0 for n in lost} | {earlier: 10.0}
    asked = set(rng.sample(used, rng.randint(1, len(used)))) | {"spare-node-not-in-the-attempt"}
    answer = group.peer_copies("p", asked)
    want = reference(attempt, 7, intact={n for n in asked if n not in lost}, torn=torn)
    assert set(answer) == set(want)
    for node, records in answer.items():  # one record per node, its ranks each once (in any order)
        assert all(len(set(r.ranks)) == len(r.ranks) for r in records)
        assert [r._replace(ranks=tuple(sorted(r.ranks))) for r in records] == holdings(want[node]), node
    assert group.peer_copies("p", {"spare-node-not-in-the-attempt"}) == {}
