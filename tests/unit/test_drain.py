"""Planned departures (issue 45), the controller's and the service's side on fake workers: `goodput nodes
drain NODE` (or Kubernetes cordoning or tainting a node to go) puts no new rank on the node and moves every
run on it off at a step boundary: its ranks stop after the same step with the state kept (their peer
snapshot; the fakes keep it in the store), the node's ranks are reseated on a spare (else the mesh
shrinks), the run goes on from that step, and nothing is charged to elastic.max_failures. The node is
then `drained` until released. The trainer's side is tests/dist/test_stop.py; a drain on the Ray cluster
is tests/cluster/test_service.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.boundary_stop import BoundaryStop, EndedStop
from controller.errors import ServiceError
from controller.failure_policy import Action, ElasticLimits, FailureCause, FailureEvent, decide
from controller.service.registry import sqlite_url
from controller.spec import parse_spec
from controller.topology import Topology
from tests.unit.fakes import FakeCluster
from tests.unit.test_service import Harness, _commit, raw_spec

CLUSTER = Topology.from_local(nodes=5, gpus_per_node=2, racks=2, spares=1)  # node-4: the spare


def states(h: Harness) -> dict[str, str]:
    return {n["name"]: n["state"] for n in h.service.cluster_view()["nodes"]}


def test_a_drain_reseats_the_nodes_ranks_on_the_spare_at_a_step_boundary_and_charges_nothing(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)), store_root=tmp_path / "ckpt")
    s = h.service
    s.add(parse_spec(raw_spec("r", dp=4, tp=2, elastic={"max_failures": 0})))  # no failure budget at all
    h.until("r", "running")
    c = s.controller("r")
    assert "node-1" in c.placement.nodes()
    h.group("r").finish_steps(1, 5)
    h.tick("r")
    row = s.drain_node("node-1", deadline=None, by="olga")
    assert (row["state"], row["runs"]) == ("draining", ["r"]) and "olga" in row["reason"]
    h.tick("r")
    h.tick("r")
    assert h.group("r").stop_requests == [("peers", "drain of node-1")], "kept by its peers, once"
    assert states(h)["node-1"] == "draining"
    h.group("r").finish_steps(6, 6)
    _commit(tmp_path / "ckpt", "r", 6, at=h.clock.t)  # (the fakes keep no peer snapshot: the store has the step)
    h.group("r").stop_at(6)
    h.tick("r")
    drained = c.events.of_kind("drained")[-1].detail
    assert drained == {"nodes": ["node-1"], "step": 6, "kept": "peers", "reason": "drain of node-1"}
    decision = c.events.of_kind("decision")[-1].detail
    assert decision["action"] == "replace" and "spare ['node-4']" in decision["reason"], decision
    assert c.failures == [] and not c.events.of_kind("failure_detected"), "not a failure: nothing charged"
    assert s.run("r")["budgets"] == {"infrastructure": {"used": 0, "max": 0}, "user_error": {"retried": False,
                                     "max_retries": 1}, "preemptions": 0, "drains": 1}
    h.until("r", "running")
    started = h.group("r").started[-1]
    assert (started.attempt, started.resume_step) == (1, 6), "0 steps redone"
    assert "node-1" not in started.placement.nodes() and "node-4" in started.placement.nodes()
    moved = [r for r in range(8) if started.placement.node_of_rank[r] != h.group("r").started[0].placement.node_of_rank[r]]
    assert {h.group("r").started[0].placement.node_of_rank[r] for r in moved} == {"node-1"}, "only its ranks moved"
    h.tick("r")
    assert states(h)["node-1"] == "drained"
    assert s.run("r")["state"] == "running"
    h.group("r").finish_steps(7, 8)
    h.tick("r")
    goodput = c.goodput(h.clock.t)
    assert goodput["failures"] == [] and goodput["badput_seconds"]["recomputation"] == 0
    assert goodput["productive_seconds"] + sum(goodput["badput_seconds"].values()) == \
        pytest.approx(goodput["wall_seconds"], abs=1e-6)
    released = s.release_node("node-1")
    assert released["state"] == "spare" and released["was"]["state"] == "drained", "it refills the spare pool"
    assert states(h)["node-1"] == "spare"


def test_a_node_with_no_run_is_drained_at_once_and_gets_no_new_rank(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)), topology=CLUSTER)
    s = h.service
    assert s.drain_node("node-0", deadline=2e9, by="olga")["runs"] == []
    h.tick()
    assert states(h)["node-0"] == "drained"
    assert "2033-05-18T03:33:20Z" in s.cluster_view()["nodes"][0]["reason"], "the deadline, said"
    assert s.drain_node("node-0", deadline=None, by="olga")["state"] == "drained", "asked again: as it is"
    s.drain_node("node-1", deadline=None, by="olga")
    s.add(parse_spec(raw_spec("r", dp=2, tp=2)))
    h.until("r", "running")
    assert s.controller("r").placement.nodes() == {"node-2", "node-3"}


def test_bad_drains_say_what_to_fix(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)), topology=CLUSTER)
    with pytest.raises(ServiceError) as e:
        h.service.drain_node("node-9", deadline=None, by="olga")
    assert e.value.code == "node_not_found" and "goodput nodes" in e.value.message
    h.service.nodes.book.quarantine("node-2", "sdc", "r", 1.0)
    with pytest.raises(ServiceError) as e:
        h.service.drain_node("node-2", deadline=None, by="olga")
    assert e.value.code == "node_out_of_use" and "release" in e.value.message
    with pytest.raises(ServiceError) as e:
        h.service.release_node("node-3")
    assert "neither quarantined nor drained" in e.value.message


class Tainted(FakeCluster):
    """A Kubernetes cluster as KubeTopologyCluster shows it: nodes cordoned or tainted to go."""

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.going: dict[str, str] = {}

    def departing(self) -> dict[str, str]:
        return dict(self.going)


def test_a_node_kubernetes_will_delete_is_drained_like_an_operators(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)), store_root=tmp_path / "ckpt")
    cluster = Tainted(CLUSTER)
    h.service.nodes.cluster = cluster
    h.service.add(parse_spec(raw_spec("r", dp=4, tp=2)))
    h.until("r", "running")
    h.group("r").finish_steps(1, 2)
    cluster.going["node-3"] = "taint ToBeDeletedByClusterAutoscaler"
    h.tick("r")
    h.tick("r")
    assert states(h)["node-3"] == "draining"
    assert h.group("r").stop_requests == [("peers", "drain of node-3")]
    assert "Kubernetes (taint ToBeDeletedByClusterAutoscaler)" in h.service.cluster_view()["nodes"][3]["reason"]


def test_a_drain_is_decided_like_a_loss_but_never_charged() -> None:
    from controller.placement import place
    from controller.planner import plan_run

    spec = parse_spec(raw_spec("r", dp=4, tp=2))
    plan, placement = plan_run(spec, CLUSTER)
    limits = ElasticLimits(min_dp=1, max_failures=2, wait_for_capacity_s=0)
    for cause, spent in ((FailureCause.NODE_LOST, 2), (FailureCause.DRAINED, 2), (FailureCause.DRAINED, 50)):
        event = FailureEvent(time=1.0, cause=cause, nodes=("node-1",))
        d = decide(1.0, event=event, failures_so_far=spent, mesh=plan.mesh, spec_mesh=plan.mesh, topology=CLUSTER,
                   limits=limits, global_batch=spec.train.global_batch, micro_batch=spec.train.micro_batch,
                   placement=placement)
        if cause is FailureCause.NODE_LOST:
            assert d.action is Action.FAIL and d.code == "failure_budget"
        else:
            assert d.action is Action.REPLACE and "drained ['node-1']" in d.reason, d.reason
            assert d.placement is not None and "node-1" not in d.placement.nodes()
    no_spare = Topology(tuple(n for n in CLUSTER.nodes if n.name != "node-4"))
    d = decide(1.0, event=FailureEvent(time=1.0, cause=FailureCause.DRAINED, nodes=("node-1",)), failures_so_far=9,
               mesh=plan.mesh, spec_mesh=plan.mesh, topology=no_spare, limits=limits,
               global_batch=spec.train.global_batch, micro_batch=spec.train.micro_batch, placement=placement)
    assert d.action is Action.SHRINK and d.mesh is not None and d.mesh.dp == 2, "no spare: shrink, keeping the batch"
    assert place(d.mesh, d.topology).nodes().isdisjoint({"node-1"})


def test_a_rank_that_got_a_sigterm_has_its_nodes_ranks_reseated_like_a_drain(tmp_path: Path) -> None:
    """The ranks agree on a SIGTERM by themselves (trainer/stop.py); the rank says `terminating` and the
    controller reseats its node's ranks once they stopped, asking nothing and charging nothing."""
    h = Harness(sqlite_url(str(tmp_path)), store_root=tmp_path / "ckpt")
    h.service.add(parse_spec(raw_spec("r", dp=4, tp=2)))
    h.until("r", "running")
    c = h.service.controller("r")
    node = c.placement.node_of_rank[5]
    h.group("r").finish_steps(1, 3)
    h.group("r").emit(5, "terminating", step=3, signal="SIGTERM", seconds_ago=0.2)
    h.tick("r")
    h.group("r").finish_steps(4, 4)
    _commit(tmp_path / "ckpt", "r", 4, at=h.clock.t)
    h.group("r").emit(0, "stopped_at_boundary", step=4, kept="peers", reason="a rank's SIGTERM")
    h.group("r").complete()
    h.tick("r")
    assert h.group("r").stop_requests == [], "the controller asked nothing"
    assert c.events.of_kind("drained")[-1].detail == {"nodes": [node], "step": 4, "kept": "peers",
                                                       "reason": f"SIGTERM on {node}"}
    h.until("r", "running")
    started = h.group("r").started[-1]
    assert (started.attempt, started.resume_step) == (1, 4) and node not in started.placement.nodes()
    assert c.failures == []


def test_a_replica_run_leaves_a_drained_node_by_its_replicas_the_others_training_on() -> None:
    """failure_domain replica: the replicas with ranks on the node stop and wait to form again elsewhere
    (from a live replica's memory), the others train on; nothing charged, nothing stops the world."""
    import yaml

    from controller.run_state import RunState
    from controller.state import RunController
    from tests.unit.fakes import FakeReplicaGroup, drive

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny-gpt-replicas.yaml").read_text())
    raw["drills"] = []
    spec = parse_spec(raw)
    group = FakeReplicaGroup()
    c = RunController(spec, spec.topology(), group, now=100.0, topology_source=spec.topology)
    drive(c, RunState.RUNNING)
    node = c.placement.node_of_rank[c.config.mesh.world_size - 1]
    group.finish_steps(1, 3, end=104.0)
    c.step(105.0)
    assert c.drain({node}, f"drain of {node}") and not c.drain({node}, "again"), "one at a time"
    c.step(110.0)
    (drained,) = c.events.of_kind("drained")
    replica = c.config.mesh.dp_replicas - 1
    assert drained.detail == {"nodes": [node], "step": 3, "kept": "replicas", "replicas": [replica],
                              "reason": f"drain of {node}"}
    assert group.lost == [([replica], (node,))] and c.state is RunState.RUNNING, "the others train on"
    assert c.failures == [] and not c.events.of_kind("failure_detected") and replica in c.replicas_out
    assert group.stop_requests == [], "no world stop"


def test_a_spot_reclaim_drills_report_says_when_the_run_left_and_that_no_step_was_lost() -> None:
    """The drill report of spot-reclaim (a pure function of the timeline): detected when a rank said
    `terminating`, drained at a step, recovered at the next attempt's first step from that step; a
    failure detected before the drain (the node died first) is reported as a failure instead."""
    from controller.drill_reports import drill_reports
    from controller.events import Event, EventKind

    def timeline(*late: tuple[float, int, EventKind, dict]) -> list[Event]:
        first = [Event(10.0, "r", 0, EventKind.DRILL_INJECTED, {"id": "drill-1", "drill": "spot-reclaim",
                                                                  "target": "node-1", "step": 6, "seconds": 30})]
        return first + [Event(t, "r", a, k, d) for t, a, k, d in late]

    left = timeline((10.4, 0, EventKind.TERMINATING, {"step": 6}),
                    (10.9, 0, EventKind.DRAINED, {"nodes": ["node-1"], "step": 7, "kept": "peers"}),
                    (10.9, 0, EventKind.DECISION, {"action": "replace"}),
                    (11.5, 1, EventKind.ATTEMPT_STARTED, {"start_step": 7, "restore_from": "peer"}),
                    (13.0, 1, EventKind.FIRST_STEP_AFTER_RECOVERY, {"step": 8, "ended_at": 12.8}))
    (report,) = drill_reports(left)
    assert (report["outcome"], report["cause"], report["decision"], report["steps_lost"]) == \
        ("recovered", "drained", "replace", 0)
    assert (report["detected_at"], report["drained_at"], report["drained_step"], report["recovered_at"]) == \
        (10.4, 10.9, 7, 12.8)
    assert report["restored_from"] == "peer" and report["attributed_to"]["nodes"] == ["node-1"]
    died_first = timeline((40.0, 0, EventKind.FAILURE_DETECTED, {"cause": "node_lost", "nodes": ["node-1"], "step": 9}),
                          (40.1, 0, EventKind.DECISION, {"action": "replace"}))
    assert drill_reports(died_first)[0]["cause"] == "node_lost", "not left in time: a node loss"


def test_a_boundary_stop_is_asked_once_sent_once_and_ends_where_the_ranks_said() -> None:
    """controller/boundary_stop.py's steps on their own: a second stop is refused while one is pending;
    the asked stop is sent once; a SIGTERM adopts the stop already asked (adding its node) or sends its
    own; the ranks' word (their step, where the state is) outranks what was asked; a group that ended
    short of its last step with a stop sent carried it out, one that reached its last step did not."""
    stop = BoundaryStop()
    assert not stop.pending and stop.to_send() is None
    assert stop.ask("peers", "drain of node-1", departing=("node-1",))
    assert not stop.ask("store", "preempted"), "one stop at a time"
    assert stop.to_send() == ("peers", "drain of node-1") and stop.to_send() is None and stop.pending
    stop.sigterm("node-2")
    assert not stop.carried_out(step=30, last_step=30), "it reached its last step: no stop"
    assert stop.carried_out(step=12, last_step=30)
    stop.heard({"step": 11, "kept": "peers"})
    ended = stop.end(12)
    assert (ended.step, ended.kept, ended.reason, ended.departing) == (11, "peers", "drain of node-1", ("node-1", "node-2"))
    assert not stop.pending and not stop.carried_out(step=12, last_step=30)

    stop.ask("store", "preempted by a higher-priority run")
    stop.sigterm("node-3")  # (asked, not sent yet: the SIGTERM's stop is that one)
    assert stop.to_send() is None
    assert stop.end(7) == EndedStop(step=7, kept="store", reason="preempted by a higher-priority run",
                                    departing=("node-3",))
    stop.sigterm("node-0")
    assert stop.end(9) == EndedStop(step=9, kept="peers", reason="SIGTERM on node-0", departing=("node-0",))
    stop.ask("store", "preempted")
    stop.drop()
    assert not stop.pending and stop.to_send() is None, "a failed attempt's stop is gone"

