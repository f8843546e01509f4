"""The failure policy, table-driven: replace with a spare, shrink dp, wait, fail, grow back."""

from __future__ import annotations

import dataclasses

import pytest

from controller.failure_policy import (
    Action, ElasticLimits, FailureCause, FailureEvent, decide, grow_target,
)
from controller.placement import Placement, place, reseat
from controller.topology import NodeState, Topology
from trainer.config import MeshShape

MESH = MeshShape(dp=2, pp=2, tp=2)
LIMITS = ElasticLimits(min_dp=1, max_failures=3, wait_for_capacity_s=60)


def topo(nodes: int, spares: int) -> Topology:
    return Topology.from_local(nodes=nodes, gpus_per_node=2, racks=2, spares=spares)


def lost(*nodes: str) -> FailureEvent:
    return FailureEvent(time=0.0, cause=FailureCause.NODE_LOST, nodes=nodes)


def run(event: FailureEvent, topology: Topology, *, failures: int = 0, limits: ElasticLimits = LIMITS,
        mesh: MeshShape = MESH, global_batch: int = 16, micro_batch: int = 2, now: float = 0.0,
        waiting_since: float | None = None):
    return decide(now, event=event, failures_so_far=failures, mesh=mesh, spec_mesh=MESH, topology=topology,
                  limits=limits, global_batch=global_batch, micro_batch=micro_batch, waiting_since=waiting_since)


@pytest.mark.parametrize(
    "nodes, spares, lost_nodes, action, dp",
    [
        (5, 1, ("node-1",), Action.REPLACE, 2),
        (6, 2, ("node-0", "node-1"), Action.REPLACE, 2),
        (4, 0, ("node-1",), Action.SHRINK, 1),
        (5, 1, ("node-0", "node-1"), Action.SHRINK, 1),
        (8, 0, ("node-3",), Action.REPLACE, 2),   # 7 healthy nodes still hold dp2: idle ones take over
    ],
)
def test_node_loss(nodes: int, spares: int, lost_nodes: tuple[str, ...], action: Action, dp: int) -> None:
    d = run(lost(*lost_nodes), topo(nodes, spares))
    assert d.action is action
    assert d.mesh is not None and (d.mesh.dp, d.mesh.pp, d.mesh.tp) == (dp, 2, 2)
    for n in lost_nodes:
        assert d.topology.node(n).state is NodeState.LOST
    if action is Action.REPLACE and spares:
        assert "spare" in d.reason and len(d.topology.spares()) == spares - len(lost_nodes)
    if action is Action.REPLACE and not spares:
        assert "idle healthy nodes take over, mesh unchanged" in d.reason, d.reason
        assert d.placement is not None and not set(lost_nodes) & set(d.placement.node_of_rank)


def test_shrink_keeps_global_batch_by_micro_batches() -> None:
    d = run(lost("node-1"), topo(4, 0))
    assert "8 micro-batches per step keep global batch 16" in d.reason


def test_shrink_skips_dp_that_does_not_divide_the_batch() -> None:
    mesh = MeshShape(dp=4, pp=1, tp=2)
    # 4 nodes x 2 GPUs, one lost: 3 TP groups left, but 12 % (3 * 2) == 0 -> dp 3; with batch 16 -> dp 2.
    assert run(lost("node-0"), topo(4, 0), mesh=mesh, global_batch=12).mesh == MeshShape(dp=3, pp=1, tp=2)
    assert run(lost("node-0"), topo(4, 0), mesh=mesh, global_batch=16).mesh == MeshShape(dp=2, pp=1, tp=2)


def test_below_min_dp_waits_then_fails() -> None:
    limits = ElasticLimits(min_dp=2, max_failures=3, wait_for_capacity_s=60)
    d = run(lost("node-1"), topo(4, 0), limits=limits, now=100.0)
    assert d.action is Action.WAIT and "dp 1 < elastic.min_dp = 2" in d.reason
    d = run(lost("node-1"), topo(4, 0), limits=limits, now=170.0, waiting_since=100.0)
    assert d.action is Action.FAIL and "after waiting 70 s" in d.reason


def test_failure_budget() -> None:
    d = run(lost("node-1"), topo(5, 1), failures=3)
    assert d.action is Action.FAIL and "4 failures exceed elastic.max_failures = 3" in d.reason


def test_rank_death_on_a_healthy_node_restarts_same_mesh() -> None:
    d = run(FailureEvent(time=0.0, cause=FailureCause.RANK_DIED, ranks=(3,)), topo(4, 0))
    assert d.action is Action.RESTART and d.mesh == MESH


def test_grow_back_when_capacity_returns() -> None:
    shrunk = MeshShape(dp=1, pp=2, tp=2)
    t = topo(4, 0).with_state("node-1", NodeState.LOST)
    assert grow_target(shrunk, MESH, t, 16, 2) is None
    t = t.with_state("node-1", NodeState.HEALTHY)
    assert grow_target(shrunk, MESH, t, 16, 2) == MESH
    assert grow_target(MESH, MESH, t, 16, 2) is None


@pytest.mark.parametrize("failures, topology, code", [
    (3, topo(5, 1), "failure_budget"),
    (0, topo(5, 1), "replaced"),
    (0, topo(4, 0), "shrunk"),
])
def test_every_decision_carries_its_code(failures: int, topology: Topology, code: str) -> None:
    assert run(lost("node-1"), topology, failures=failures).code == code
    assert run(FailureEvent(time=0.0, cause=FailureCause.RANK_DIED, ranks=(3,)), topo(5, 1)).code == "restarted"


def test_waiting_and_no_capacity_have_codes_and_the_controller_uses_them() -> None:
    limits = ElasticLimits(min_dp=2, max_failures=3, wait_for_capacity_s=60)
    assert run(lost("node-1"), topo(4, 0), limits=limits).code == "waiting_for_capacity"
    late = run(lost("node-1"), topo(4, 0), limits=limits, now=70.0, waiting_since=0.0)
    assert late.action is Action.FAIL and late.code == "no_capacity"


def test_an_hsdp_shrink_keeps_the_layout_and_says_why_dp_is_lower() -> None:
    """dp 4 as 2 replicas x 2 shards on 8 two-GPU nodes (tp 2, pp 1); one node lost, no spare: 7 nodes
    would hold dp 3, but HSDP needs a multiple of dp_replicas: dp 2 with the replicas kept."""
    mesh = MeshShape(dp=4, pp=1, tp=2, dp_replicas=2)
    d = run(lost("node-1"), topo(4, 0), mesh=mesh, global_batch=24, micro_batch=2)
    assert d.action is Action.SHRINK and d.mesh == MeshShape(dp=2, pp=1, tp=2, dp_replicas=2)
    assert "dp_replicas 2 kept" in d.reason and "dp 3 would fit without it" in d.reason


def test_a_shrink_that_does_not_fit_memory_waits_and_says_so() -> None:
    limits = ElasticLimits(min_dp=1, max_failures=3, wait_for_capacity_s=60)

    def fits(mesh: MeshShape) -> str | None:
        return None if mesh.dp >= 2 else "90.0 GiB per GPU > 80.0 GiB"

    d = decide(0.0, event=lost("node-1"), failures_so_far=0, mesh=MESH, spec_mesh=MESH, topology=topo(4, 0),
               limits=limits, global_batch=16, micro_batch=2, fits=fits)
    assert d.action is Action.WAIT and d.code == "waiting_for_capacity"
    assert "dp 1 does not fit: 90.0 GiB per GPU > 80.0 GiB" in d.reason, d.reason


def test_a_replacement_moves_only_the_lost_nodes_ranks() -> None:
    """The twenty-drill cluster test's case: the run on node-4 (rack 0) and node-1 (rack 1), node-0 and
    node-2 (rack 0) back from repair, node-4 lost. A fresh placement put the pipeline on node-0 and
    node-2 (one rack): node-1, which held the peer snapshots, was left out and the run restarted
    from step 0. The survivor keeps its ranks; the lost node's go to a healthy idle node, its own
    rack's first."""
    mesh = MeshShape(dp=2, pp=2, tp=1)
    topology = topo(5, 0).with_states({"node-3": NodeState.LOST})
    before = Placement(mesh=mesh, node_of_rank=("node-4", "node-4", "node-1", "node-1"), gpu_of_rank=(0, 1, 0, 1),
                       rack_of_node={"node-4": "rack-0", "node-1": "rack-1"}, spares=())
    d = decide(0.0, event=lost("node-4"), failures_so_far=0, mesh=mesh, spec_mesh=mesh, topology=topology,
               limits=LIMITS, global_batch=16, micro_batch=2, placement=before)
    assert d.action is Action.REPLACE and d.placement is not None
    assert d.placement.node_of_rank == ("node-0", "node-0", "node-1", "node-1"), d.placement
    assert d.placement.gpu_of_rank == before.gpu_of_rank
    assert d.placement.rack_of_node == {"node-0": "rack-0", "node-1": "rack-1"}
    fresh = decide(0.0, event=lost("node-4"), failures_so_far=0, mesh=mesh, spec_mesh=mesh, topology=topology,
                   limits=LIMITS, global_batch=16, micro_batch=2)
    assert fresh.placement is not None and "node-1" not in fresh.placement.node_of_rank  # what it did before


def test_a_spare_takes_exactly_the_lost_nodes_place_and_a_restart_keeps_the_placement() -> None:
    topology = topo(6, 2)
    before = place(MESH, topology)
    victim = before.node_of_rank[2]
    d = run(lost(victim), topology)
    d_kept = decide(0.0, event=lost(victim), failures_so_far=0, mesh=MESH, spec_mesh=MESH, topology=topology,
                    limits=LIMITS, global_batch=16, micro_batch=2, placement=before)
    assert d.action is d_kept.action is Action.REPLACE and d_kept.placement is not None
    spare = d_kept.placement.node_of_rank[2]
    assert spare in {"node-4", "node-5"} and d_kept.topology.node(spare).state is NodeState.HEALTHY
    assert [n if n != victim else spare for n in before.node_of_rank] == list(d_kept.placement.node_of_rank)
    assert d_kept.topology.spares() == d.topology.spares(), "the spare promoted is the one placed"
    assert d_kept.placement.spares == tuple(n.name for n in d_kept.topology.spares()) == d.placement.spares
    restart = decide(0.0, event=FailureEvent(time=0.0, cause=FailureCause.RANK_DIED, ranks=(3,)), failures_so_far=0,
                     mesh=MESH, spec_mesh=MESH, topology=d_kept.topology, limits=LIMITS, global_batch=16,
                     micro_batch=2, placement=d_kept.placement)
    assert restart.action is Action.RESTART and restart.placement is d_kept.placement
    elsewhere = decide(0.0, event=FailureEvent(time=0.0, cause=FailureCause.RANK_DIED, ranks=(3,)), failures_so_far=0,
                       mesh=MESH, spec_mesh=MESH, topology=d_kept.topology.with_state(spare, NodeState.QUARANTINED),
                       limits=LIMITS, global_batch=16, micro_batch=2, placement=d_kept.placement)
    # a node of the placement no longer healthy (the healthy nodes left no longer hold the mesh): the
    # spare left takes exactly its place, as after its loss (a fresh placement could not be made)
    assert elsewhere.action is Action.REPLACE and elsewhere.placement is not None, elsewhere
    other = ({"node-4", "node-5"} - {spare}).pop()
    assert [n if n != spare else other for n in d_kept.placement.node_of_rank] == list(elsewhere.placement.node_of_rank)


def test_no_reseat_when_a_survivor_is_no_longer_healthy_or_nothing_fits() -> None:
    topology = topo(6, 0)
    before = place(MESH, topology)
    survivor = before.node_of_rank[-1]
    assert reseat(before, topology.with_states({survivor: NodeState.QUARANTINED}), [before.node_of_rank[0]]) is None
    small = Topology(tuple(n if n.name in before.nodes() else dataclasses.replace(n, num_gpus=1) for n in topology.nodes))
    assert reseat(before, small, [before.node_of_rank[0]]) is None, "a 1-GPU node cannot take a 2-GPU TP group"


def test_a_failure_without_nodes_after_nodes_were_lost_decides_on_the_nodes_left() -> None:
    """A replica failed while it formed (a worker error: no node named), with another replica still out
    and its node lost: the failed attempt's placement holds that node, so the same mesh on the same
    nodes is not there to restart. Decided as after a loss without a spare (here: shrink to what the
    healthy nodes hold), never a restart whose placement cannot be made (it ended the run with
    controller_error)."""
    topology = topo(4, 0)
    placement = place(MESH, topology)
    topology = topology.with_state("node-3", NodeState.LOST)  # (the other replica's node, lost earlier)
    d = decide(0.0, event=FailureEvent(time=0.0, cause=FailureCause.WORKER_ERROR, message="could not form"),
               failures_so_far=1, mesh=MESH, spec_mesh=MESH, topology=topology, limits=LIMITS, global_batch=16,
               micro_batch=2, placement=placement)
    assert d.action is Action.SHRINK and d.mesh is not None and d.mesh.dp == 1, d
    assert d.placement is not None and d.placement.nodes() <= topology.names_in(NodeState.HEALTHY)
    # nodes still all healthy: the same mesh restarts where it ran
    d = decide(0.0, event=FailureEvent(time=0.0, cause=FailureCause.WORKER_ERROR), failures_so_far=1, mesh=MESH,
               spec_mesh=MESH, topology=topo(4, 0), limits=LIMITS, global_batch=16, micro_batch=2, placement=placement)
    assert d.action is Action.RESTART and d.placement == placement
