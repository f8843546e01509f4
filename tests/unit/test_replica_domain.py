"""The replica domain (controller/replicas.py) on its own, without a run controller: which failures it
contains, what taking a replica out says and asks of the worker group, where the replica forms again,
and when the survivors' stall ends. Four replicas of one rank each on node-0..3, node-4 the spare."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from controller.attribution import AttemptWatch
from controller.events import EventKind, EventLog
from controller.failure_policy import FailureCause, FailureEvent
from controller.placement import Placement, place
from controller.replicas import ReplicaDomain
from controller.spec import ElasticSpec
from controller.topology import NodeState, Topology
from trainer.config import MeshShape
from trainer.report import StepReport

MESH = MeshShape(dp=4, dp_replicas=4)
TOPOLOGY = Topology.from_local(nodes=5, gpus_per_node=1, racks=1, spares=1)
PLACEMENT = place(MESH, TOPOLOGY)


class ReplicaGroup:
    """What a worker group that runs each replica as its own world is asked (`refuse`: forming fails)."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.calls: list[tuple[str, list[int], Any]] = []
        self.refuse = refuse

    def start(self, attempt: Any) -> None: ...
    def poll(self) -> Any: ...
    def shutdown(self) -> None: ...

    def contains_replicas(self) -> bool:
        return True

    def lose_replicas(self, replicas: list[int], nodes: tuple[str, ...], *, suspect: bool = False) -> float:
        self.calls.append(("lose", replicas, (nodes, suspect)))
        return 12.5

    def form_replicas(self, replicas: list[int], placement: Placement) -> None:
        self.calls.append(("form", replicas, placement.node_of_rank))
        if self.refuse:
            raise RuntimeError("no warm actor on node-4")


def domain(group: ReplicaGroup | None = None, **elastic: Any) -> tuple[ReplicaDomain, EventLog]:
    events = EventLog("r")
    spec = ElasticSpec(**{"failure_domain": "replica", "max_failures": 3, "batch_while_healing": "shrink", **elastic})
    return ReplicaDomain(events, group or ReplicaGroup(), spec, contextlib.nullcontext), events


def watch() -> AttemptWatch:
    return AttemptWatch(0, MESH, PLACEMENT.node_of_rank, last_step=100, straggler_ratio=2.0, straggler_action="report",
                        hang_factor=10.0, hang_floor_s=60.0)


NODE_1 = FailureEvent(time=0.0, cause=FailureCause.NODE_LOST, nodes=("node-1",))


@pytest.mark.parametrize(("failure", "elastic", "failures", "lost"), [
    (NODE_1, {}, 0, (1,)),
    (FailureEvent(time=0.0, cause=FailureCause.RANK_DIED, ranks=(2,)), {}, 0, (2,)),
    (FailureEvent(time=0.0, cause=FailureCause.NODE_LOST, nodes=("node-0", "node-3")), {}, 0, (0, 3)),
    (NODE_1, {"failure_domain": "world"}, 0, None),
    (NODE_1, {}, 3, None),  # the 4th failure is past max_failures = 3: the world path says so
    (FailureEvent(time=0.0, cause=FailureCause.HANG, ranks=(1,)), {}, 0, None),  # a hang may be anyone's
    (FailureEvent(time=0.0, cause=FailureCause.SDC, ranks=(1,)), {}, 0, None),  # not shown to stay in replica 1
    (FailureEvent(time=0.0, cause=FailureCause.SDC, ranks=(1,), contained=True), {}, 0, (1,)),
    (FailureEvent(time=0.0, cause=FailureCause.NODE_LOST, nodes=("node-0", "node-1", "node-2", "node-3")), {}, 0,
     None),  # no replica would live on
    (FailureEvent(time=0.0, cause=FailureCause.NODE_LOST, nodes=("node-4",)), {}, 0, None),  # no rank there
])
def test_which_failures_it_contains(failure: FailureEvent, elastic: dict[str, Any], failures: int,
                                    lost: tuple[int, ...] | None) -> None:
    d, events = domain(**elastic)
    held = d.contains(failure, mesh=MESH, placement=PLACEMENT, failures=failures)
    assert (held.lost if held is not None else None) == lost
    if held is not None:
        assert held.live == 4 - len(lost or ())
    assert len(events) == 0 and d.out == {}, "a verdict changes nothing"


def test_a_replica_taken_out_forms_again_on_the_spare_and_rejoins() -> None:
    group = ReplicaGroup()
    d, events = domain(group)
    w = watch()
    held = d.contains(NODE_1, mesh=MESH, placement=PLACEMENT, failures=0)
    assert held is not None
    d.take_out(50.0, NODE_1, held, attempt=0, mesh=MESH, placement=PLACEMENT, watch=w)
    assert [e.kind for e in events] == [EventKind.DECISION, EventKind.REPLICA_LOST]
    decision, lost = list(events)
    assert decision.detail["code"] == "replica_out" and "replica(s) [1] stop, 3 of 4 train on (shrink" in \
        decision.detail["reason"]
    assert lost.detail == {"replicas": [1], "nodes": ["node-1"], "live": 3, "of": 4, "batch": "shrink",
                           "told_at": 12.5}
    assert group.calls == [("lose", [1], (("node-1",), False))]
    assert d.out == {1: ("node-1",)} and d.survivors_since == 50.0
    # News of the same replica before it forms stops nothing more.
    again = d.contains(FailureEvent(time=0.0, cause=FailureCause.RANK_DIED, ranks=(1,)), mesh=MESH,
                       placement=PLACEMENT, failures=1)
    assert again is not None and again.lost == () and again.live == 3

    topology = TOPOLOGY.with_states({"node-1": NodeState.LOST})
    formed = d.formation(topology, PLACEMENT, cluster=None)
    assert formed is not None and formed.replicas == (1,)
    assert formed.placement.node_of_rank == ("node-0", "node-4", "node-2", "node-3")
    assert formed.topology.node("node-4").state is NodeState.HEALTHY
    assert d.form(51.0, formed, w) is None
    assert group.calls[-1] == ("form", [1], ("node-0", "node-4", "node-2", "node-3"))
    assert w.node_of_rank == formed.placement.node_of_rank and d.forming == {1}
    assert d.formation(formed.topology, formed.placement, cluster=None) is None, "none waits"
    # Lost again while it forms: it is taken out once more (to form elsewhere).
    joining = FailureEvent(time=0.0, cause=FailureCause.NODE_LOST, nodes=("node-4",))
    held = d.contains(joining, mesh=MESH, placement=formed.placement, failures=1)
    assert held is not None and held.lost == (1,)

    d.rejoined(["1"])
    assert d.out == {} and d.forming == set()


def test_the_survivors_stall_ends_with_the_first_step_begun_after_it() -> None:
    d, events = domain()
    d.resynced(40.0)
    d.resynced(45.0)  # (the stall began at the first)

    def report(step: int, end: float) -> StepReport:
        return StepReport(rank=0, attempt=0, step=step, cursor=0, loss=None, step_time_s=2.0, data_s=0.0,
                          compute_s=1.0, wait_s=1.0, tokens_per_s=1.0, end_time=end)

    d.survivors_stepped(50.0, 0, [report(7, 41.0)])  # begun at 39 s: before the stall
    assert len(events) == 0
    d.survivors_stepped(50.0, 0, [report(8, 43.0), report(9, 52.0)])
    (first,) = list(events)
    assert first.kind == EventKind.FIRST_STEP_AFTER_RECOVERY
    assert first.detail == {"step": 8, "ended_at": 43.0, "survivors": True}
    assert d.survivors_since is None


def test_with_no_node_free_it_waits_and_a_group_that_cannot_form_hands_over_to_the_world_path() -> None:
    group = ReplicaGroup(refuse=True)
    d, _ = domain(group)
    lost, ranks = d.adopt({1: ("node-1",)}, MESH)
    assert lost == {"node-1"} and ranks == {1}
    full = TOPOLOGY.with_states({"node-1": NodeState.LOST, "node-4": NodeState.LOST})
    waits = d.formation(full, PLACEMENT, cluster=None)
    assert waits is not None and waits.replicas == () and waits.placement is PLACEMENT
    listed = Topology(tuple(n for n in TOPOLOGY.nodes if n.name != "node-1"))  # node-4 alive again, node-1 not
    formed = d.formation(full, PLACEMENT, cluster=lambda: listed)
    assert formed is not None and formed.replicas == (1,) and formed.placement.node_of_rank[1] == "node-4"
    failure = d.form(60.0, formed, watch())
    assert failure is not None and failure.cause is FailureCause.WORKER_ERROR
    assert failure.message == "replica(s) [1] could not be formed again: RuntimeError: no warm actor on node-4"
    d.reset()
    assert d.out == {} and d.forming == set() and d.survivors_since is None


def test_a_formation_that_fails_with_another_replica_still_out_hands_the_world_path_a_mesh_that_places() -> None:
    """Two replicas out (node-1, node-2 lost), one spare: replica 1 forms on node-4 and the group
    refuses. The world path's decision on the formation's topology and placement (which still holds
    node-2) was a restart of the same mesh on nodes that no longer hold it, and the run ended with
    controller_error; it is decided on the healthy nodes instead."""
    from controller.failure_policy import Action, ElasticLimits, decide

    d, _ = domain(ReplicaGroup(refuse=True))
    d.adopt({1: ("node-1",), 2: ("node-2",)}, MESH)
    full = TOPOLOGY.with_states({"node-1": NodeState.LOST, "node-2": NodeState.LOST})
    formed = d.formation(full, PLACEMENT, cluster=None)
    assert formed is not None and formed.replicas == (1,) and "node-2" in formed.placement.nodes()
    failure = d.form(60.0, formed, watch())
    assert failure is not None
    decision = decide(60.0, event=failure, failures_so_far=2, mesh=MESH, spec_mesh=MESH, topology=formed.topology,
                      limits=ElasticLimits(min_dp=1, max_failures=5, wait_for_capacity_s=60), global_batch=8,
                      micro_batch=1, by_replica=True, placement=formed.placement)
    healthy = formed.topology.names_in(NodeState.HEALTHY)
    assert decision.action is Action.SHRINK and decision.mesh is not None and decision.mesh.dp == 2, decision
    assert decision.placement is not None and decision.placement.nodes() <= healthy
