"""`elastic.failure_domain: replica` in the simulator, checked by hand on tiny cases: a kill-node stops
one replica, the survivors pay detection + one cross-replica init and train on at half throughput
until the replica, formed again on the spare, receives their state and rejoins, all in one attempt;
shrinking the batch instead keeps the step time and counts the missing share; with no spare the
replica waits for its node's repair; a node that holds every replica stops the world as before."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from controller.events import EventKind
from controller.sim.model import comm_init_s, cost_model, restart_s
from controller.sim.run import simulate
from controller.spec import parse_spec
from tests.unit.test_simulate import TINY, spec

REPLICAS = {"dp": 2, "tp": 1, "pp": 1, "dp_replicas": 2}
KILL_AT_25 = [{"kind": "kill-node", "at_step": 25}]


def replica_spec(**changes: Any) -> Any:
    elastic = {"max_failures": 1000, "failure_domain": "replica", **changes.pop("elastic", {})}
    changes.setdefault("drills", KILL_AT_25)
    changes.setdefault("parallelism", REPLICAS)
    return spec(elastic=elastic, **changes)


def kinds(result: dict[str, Any], *wanted: str) -> list[Any]:
    return [e for e in result["_controller"].events if e.kind in wanted]


def test_a_lost_node_stops_its_replica_only_and_it_rejoins_from_the_survivor() -> None:
    result = simulate(replica_spec(), days=1)
    g = result["goodput"]
    assert result["state"] == "succeeded" and result["steps"] == 100 and result["attempts"] == 1
    assert result["decisions"] == {"heal_replica": 1}
    (failure,) = g["failures"]
    # The drill lands at step 25's end: 25 steps of 1 s and the saves after 10 and 20 (0.5 s each).
    assert failure["onset"] == pytest.approx(26.0)
    # Detection: by hand from the timeline (the drill's injection -> the failure detected), against the
    # cost model's figure for this spec (the survivors' collective fails at once and the controller's
    # raylet probe confirms the node), and against the world path on the same spec without its
    # override, which detects a loud node loss from the data plane as well.
    injected = kinds(result, EventKind.DRILL_INJECTED)[0].time
    detected = kinds(result, EventKind.FAILURE_DETECTED)[0].time
    assert failure["detection_seconds"] == pytest.approx(detected - injected)
    s = replica_spec()
    model = cost_model(s, params=s.to_model_config().num_params(), gpus=2, gpus_per_node=1, replicas=2)
    assert detected - injected == pytest.approx(model.replica_detection_s)
    plain = {**copy.deepcopy(TINY), "parallelism": REPLICAS, "drills": KILL_AT_25}
    del plain["cost"]["node_loss_detection_s"]
    world_path = simulate(parse_spec(plain), days=1)["goodput"]["failures"]
    assert detected - injected == pytest.approx(world_path[0]["detection_seconds"])
    assert failure["recovery_seconds"] == pytest.approx(comm_init_s(1))  # the survivors' cross-replica init
    assert failure["recomputation_seconds"] == pytest.approx(0.0)  # the step in flight had just begun
    # The replica on the spare is ready restart_s(1) after the decision; the survivor's step 26 (2 s:
    # the whole batch on one replica) ends after that, and the rejoin stalls it for one more init.
    survivors_resume = 27.0 + comm_init_s(1)
    assert 27.0 + restart_s(1) < survivors_resume + 2.0
    (rejoined,) = kinds(result, EventKind.REPLICA_REJOINED)
    assert rejoined.detail["replicas"] == [1] and rejoined.detail["source"] == 0 and rejoined.detail["step"] == 26
    assert rejoined.detail["seconds"] == pytest.approx(comm_init_s(2), rel=1e-3)  # + the (tiny) state transfer
    assert failure["rejoined_at"] == pytest.approx(survivors_resume + 2.0 + rejoined.detail["seconds"])
    assert failure["degraded_seconds"] == pytest.approx(1.0)  # step 26 took 2 s where the full mesh takes 1
    assert g["badput_seconds"]["degraded_capacity"] == pytest.approx(1.0)
    assert g["badput_seconds"]["restart_restore"] == pytest.approx(comm_init_s(1) + rejoined.detail["seconds"])
    assert g["badput_seconds"]["recomputation"] == pytest.approx(0.0)
    (report,) = result["_controller"].drill_reports()
    assert report["outcome"] == "recovered" and report["restored_from"] == "replica" and report["steps_lost"] == 0
    (lost,) = kinds(result, EventKind.REPLICA_LOST)
    assert lost.detail["replicas"] == [1] and lost.detail["live"] == 1 and lost.detail["of"] == 2
    world = simulate(spec(parallelism=REPLICAS, drills=KILL_AT_25), days=1)
    assert world["attempts"] == 2 and world["ettr"] < result["ettr"]


def test_shrinking_the_batch_keeps_the_step_time_and_counts_the_missing_share() -> None:
    result = simulate(replica_spec(elastic={"batch_while_healing": "shrink"}), days=1)
    (failure,) = result["goodput"]["failures"]
    # Step 26 takes 1 s on one replica, half the batch: half of it is the missing replica's share.
    assert failure["degraded_seconds"] == pytest.approx(0.5)
    spans = result["_controller"].progress.history
    assert all(h["end"] - h.get("start", h["end"] - 1.0) == pytest.approx(1.0) for h in spans if "start" in h)


def test_with_no_spare_the_replica_waits_for_its_node_to_be_repaired() -> None:
    repair_h = 0.01  # 36 s
    result = simulate(replica_spec(cluster={"simulated": {"nodes": 2, "gpus_per_node": 1, "racks": 1, "spares": 0}},
                                   failures={"repair_hours": {"host": repair_h}}), days=1)
    (failure,) = result["goodput"]["failures"]
    assert result["attempts"] == 1 and result["state"] == "succeeded"
    # Out from the decision (27 s) until the node is back (26 + 36 s) and the replica has started and joined.
    assert failure["rejoined_at"] > 26.0 + repair_h * 3600 + restart_s(1)
    assert failure["rejoined_at"] < 26.0 + repair_h * 3600 + restart_s(1) + 2.0 + 1.0
    assert failure["degraded_seconds"] == pytest.approx((failure["rejoined_at"] - 27.0) / 2, rel=0.1)


def test_a_node_that_holds_every_replica_stops_the_world() -> None:
    result = simulate(replica_spec(cluster={"simulated": {"nodes": 2, "gpus_per_node": 2, "racks": 1, "spares": 1}}),
                      days=1)
    assert result["attempts"] == 2 and result["decisions"] == {"replace": 1}
    assert not kinds(result, EventKind.REPLICA_LOST)


def test_a_dead_rank_stops_its_replica_only_and_it_is_formed_again_in_place() -> None:
    result = simulate(replica_spec(drills=[{"kind": "kill-rank", "at_step": 25, "target": "1"}]), days=1)
    assert result["attempts"] == 1 and result["decisions"] == {"heal_replica": 1}
    (failure,) = result["goodput"]["failures"]
    assert failure["cause"] == "rank_died" and failure["detection_seconds"] == pytest.approx(0.0, abs=1e-3)
    (rejoined,) = kinds(result, EventKind.REPLICA_REJOINED)
    assert rejoined.detail["replicas"] == [1]
    c = result["_controller"]
    assert c.placement is not None and set(c.placement.node_of_rank) == {"node-0", "node-1"}, "no node was replaced"


def test_a_replica_that_cannot_be_formed_again_hands_the_run_to_the_world_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.sim.group import SimWorkerGroup

    def refuse(self: SimWorkerGroup, replicas: list[int], placement: Any) -> None:
        raise RuntimeError("no idle warm actor on node-2")

    monkeypatch.setattr(SimWorkerGroup, "form_replicas", refuse)
    result = simulate(replica_spec(), days=1)
    assert result["state"] == "succeeded" and result["steps"] == 100
    assert result["attempts"] == 2 and result["decisions"].get("heal_replica") == 1
    detected = kinds(result, EventKind.FAILURE_DETECTED)
    assert "could not be formed again" in detected[-1].detail["message"]


def test_a_bitflip_found_at_rest_quarantines_its_node_and_heals_only_its_replica() -> None:
    """A replica's probes find a bit flipped at rest before its gradient meets the other replica's
    (trainer/probes.py), so the survivor's state is vouched: the node is quarantined, its replica is
    formed again on the spare and takes the survivor's state, in the same attempt. Stop-the-world
    handles the same drill with a second attempt from the store."""
    result = simulate(replica_spec(drills=[{"kind": "bitflip", "at_step": 25, "target": "1"}]), days=1)
    assert result["state"] == "succeeded" and result["attempts"] == 1
    assert result["decisions"] == {"heal_replica": 1}
    (failure,) = result["goodput"]["failures"]
    assert failure["cause"] == "sdc"
    (quarantined,) = kinds(result, EventKind.QUARANTINED)
    assert quarantined.detail["node"] == "node-1" and quarantined.detail["reason"] == "sdc"
    (rejoined,) = kinds(result, EventKind.REPLICA_REJOINED)
    assert rejoined.detail["replicas"] == [1] and rejoined.detail["source"] == 0
    c = result["_controller"]
    assert c.placement is not None and "node-1" not in c.placement.node_of_rank
    world = simulate(spec(parallelism=REPLICAS, drills=[{"kind": "bitflip", "at_step": 25, "target": "1"}]), days=1)
    assert world["attempts"] == 2


def test_the_world_path_of_a_replica_run_restores_from_each_replicas_own_peer_snapshots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer snapshots per replica (each replica's ranks keep each other's copies, named by local rank):
    when the run falls back to the world path (here: the lost replica cannot be formed again), the next
    attempt loads the last step from the replicas' own nodes' host memory, not from the store."""
    from controller.sim.group import SimWorkerGroup

    def refuse(self: SimWorkerGroup, replicas: list[int], placement: Any) -> None:
        raise RuntimeError("no idle warm actor on node-4")

    monkeypatch.setattr(SimWorkerGroup, "form_replicas", refuse)
    raw = dict(parallelism={"dp": 4, "tp": 1, "pp": 1, "dp_replicas": 2},
               cluster={"simulated": {"nodes": 5, "gpus_per_node": 1, "racks": 1, "spares": 1}},
               checkpoint={"peer_every_steps": 1})
    result = simulate(replica_spec(**raw), days=1)
    assert result["state"] == "succeeded" and result["steps"] == 100 and result["attempts"] == 2
    started = kinds(result, EventKind.ATTEMPT_STARTED)
    assert started[0].detail["restore_from"] is None
    again = started[1].detail
    assert again["restore_from"] == "peer" and again["start_step"] == 25, again
    assert again["peer_replicas"], "no replica's nodes held the step whole"
    store = simulate(replica_spec(**{**raw, "checkpoint": {"peer_every_steps": 0}}), days=1)
    assert kinds(store, EventKind.ATTEMPT_STARTED)[1].detail["restore_from"] == "store"


def test_a_collective_fault_costs_one_step_and_a_resync_with_nothing_stopped() -> None:
    """The collective-fault drill in the simulator (the Ray path: tests/cluster/test_replica_domain.py):
    the step in flight is discarded at its reduce, the controller publishes an epoch of the same
    members, and the replicas do the step again: one attempt, no failure, no decision, and the wall
    longer than a clean run's by one step + detection + the epoch's init, computed by hand."""
    clean = simulate(replica_spec(drills=[]), days=1)
    result = simulate(replica_spec(drills=[{"kind": "collective-fault", "at_step": 25, "target": "replica:1"}]),
                      days=1)
    assert result["state"] == "succeeded" and result["steps"] == 100 and result["attempts"] == 1
    g, clean_g = result["goodput"], clean["goodput"]
    assert result["decisions"] == {} and g["failures"] == []
    (discarded,) = kinds(result, EventKind.REPLICA_STEP_DISCARDED)
    assert discarded.detail["step"] == 26
    (report,) = result["_controller"].drill_reports()
    assert report["kind"] == "collective-fault" and report["point"] == "reduce" and report["target"] == "1"
    assert report["decision"] == "resync" and report["outcome"] == "recovered" and report["steps_lost"] == 0
    s = replica_spec()
    model = cost_model(s, params=s.to_model_config().num_params(), gpus=2, gpus_per_node=1, replicas=2)
    extra = model.step_s + model.replica_detection_s + comm_init_s(2)
    assert g["wall_seconds"] - clean_g["wall_seconds"] == pytest.approx(extra, abs=1e-6)
    # Charged to its causes: the discarded step's work, the wait for the epoch, its forming.
    badput, before = g["badput_seconds"], clean_g["badput_seconds"]
    assert badput["recomputation"] - before["recomputation"] == pytest.approx(model.step_s)
    assert badput["failure_detection"] - before["failure_detection"] == pytest.approx(model.replica_detection_s)
    assert badput["restart_restore"] - before["restart_restore"] == pytest.approx(comm_init_s(2))
    assert badput["other"] == pytest.approx(before["other"])


def test_a_collective_late_by_less_than_the_timeout_is_ridden_out() -> None:
    result = simulate(replica_spec(drills=[{"kind": "collective-fault", "at_step": 25, "target": "1", "seconds": 3}]),
                      days=1)
    assert result["attempts"] == 1 and not kinds(result, EventKind.REPLICA_STEP_DISCARDED)
    (report,) = result["_controller"].drill_reports()
    assert report["outcome"] == "ridden_out" and report["seconds"] == 3
