"""One data-parallel replica as the failure domain on a real local Ray cluster: a node of one replica
SIGKILLed (raylet and every process on it) stops that replica only; the other trains on in the same
attempt, the lost replica is formed again on the spare, takes the survivor's state and rejoins, and
at the end both replicas hold the same bytes."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from controller.ray.cluster import LocalRayCluster
from controller.ray.runner import drive
from controller.run_state import RunState
from controller.spec import RunSpec, parse_spec
from controller.state import RunController
from tests.cluster.test_fault_tolerance import check_cursor_accounting, restore_node, spec

pytestmark = pytest.mark.cluster


def replica_spec(name: str, root: Path, *, replicas: int = 2, parallelism: dict | None = None,
                 elastic: dict | None = None, changes: dict | None = None, **kwargs: Any) -> RunSpec:
    """`spec` of test_fault_tolerance (five nodes, one a spare) as two replicas (or `replicas` of the
    `parallelism` given), each its own failure domain; `changes`: sections to update (train, health)."""
    drills = kwargs.pop("drills")
    raw = spec(name, root, nodes=5, spares=1, elastic={"failure_domain": "replica", **(elastic or {})}, drills=[],
               **kwargs).model_dump()
    for section, values in (changes or {}).items():
        raw[section] = {**raw[section], **values}
    return parse_spec({**raw, "parallelism": {**raw["parallelism"], **(parallelism or {}), "dp_replicas": replicas},
                       "drills": drills})


def give_up_after(seconds: float) -> Any:
    """An on_tick that cancels a run still going `seconds` after its first tick (its events then say
    where it stood, instead of the suite's timeout)."""
    began: list[float] = []

    def tick(c: RunController) -> None:
        if not began:
            began.append(time.monotonic())
        if time.monotonic() - began[0] > seconds and not c.state.terminal:
            c.cancel()

    return tick


def print_timeline(c: RunController) -> None:
    """The run's events, one line each (pytest shows them when the test fails): what the replicas did."""
    for e in c.events:
        if e.kind in ("checkpoint_staged", "checkpoint_committed"):
            continue
        detail = {k: v for k, v in e.detail.items() if k not in ("checksums", "reason", "message", "placement", "evidence")}
        print("EV", round(e.time - c.created_at, 2), e.kind, str(detail)[:300])


def restore_nodes(cluster: LocalRayCluster) -> None:
    for i in range(5):
        restore_node(cluster, f"node-{i}")


def test_a_lost_node_stops_its_replica_only_and_it_rejoins_with_the_survivors_bytes(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """dp2 (two replicas of pp2 x tp2, each on two nodes of 2 GPUs) and a spare; node-3 (replica 1's)
    is killed after step 6. The survivors train 34 more steps: forming a replica on the spare took
    ~6 s on 2 loaded cores (~20 steps), and a run that ends first leaves it out."""
    s = replica_spec("replicas", tmp_path, drills=[{"kind": "kill-node", "at_step": 6}], steps=40)
    try:
        c = drive(s, ray_cluster)
    finally:
        restore_node(ray_cluster, "node-3")
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    assert c.progress.step == 40
    assert len(c.events.of_kind("attempt_started")) == 1, "the run never stopped the world"
    (report,) = c.to_dict(0)["drills"]
    assert report["cause"] == "node_lost" and report["attributed_to"]["nodes"] == ["node-3"], report
    assert report["decision"] == "heal_replica" and report["outcome"] == "recovered", report
    assert report["restored_from"] == "replica" and report["steps_lost"] == 0, report
    assert report["detection_s"] < 5.0, f"node loss detected in {report['detection_s']:.1f} s"
    (lost,) = [e.detail for e in c.events.of_kind("replica_lost")]
    assert lost["replicas"] == [1] and lost["live"] == 1
    (rejoined,) = [e.detail for e in c.events.of_kind("replica_rejoined")]
    assert rejoined["replicas"] == [1] and rejoined["source"] == 0, rejoined
    assert c.events.of_kind("replica_step_discarded"), "the survivors' failed collective was not reported"
    assert "node-4" in c.placement.node_of_rank, "the spare did not take node-3's place"
    sums = [e.detail for e in c.events.of_kind("replica_checksums")]
    assert len(sums) == 4 and all(d["agree"] and d["replicas"] == [0, 1] for d in sums), sums
    # The survivors' steps between the loss and the rejoin were committed: the history has every
    # step once, and every committed checkpoint's cursor is step x global batch.
    assert [h["step"] for h in c.progress.history] == list(range(1, 41))
    check_cursor_accounting(tmp_path, "replicas")


def test_a_flipped_bit_quarantines_its_node_and_heals_only_its_replica_from_the_vouched_one(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """The same mesh; a bit flips at rest in rank 7's parameters (replica 1, node-3) after step 6. Its
    replica's probes find it before that replica's gradient meets replica 0's, so replica 0's state is
    vouched: node-3 is quarantined, replica 1 is formed again on the spare from replica 0's state, in
    the same attempt, and both replicas end with the same bytes. 40 steps: time to form it again
    under load (the first test's docstring)."""
    s = replica_spec("replica-sdc", tmp_path, drills=[{"kind": "bitflip", "at_step": 6, "target": "7"}], steps=40)
    s = s.model_copy(update={"health": s.health.model_copy(update={"sdc_every_steps": 4})})
    c = drive(s, ray_cluster)
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    assert len(c.events.of_kind("attempt_started")) == 1, "the run stopped the world for one replica's bit"
    (report,) = c.to_dict(0)["drills"]
    assert report["cause"] == "sdc" and report["decision"] == "heal_replica", report
    assert report["outcome"] == "recovered" and report["restored_from"] == "replica", report
    (suspect,) = [e.detail for e in c.events.of_kind("sdc_suspect")]
    assert suspect["contained"] and suspect["ranks"] == [7], suspect
    assert [q["node"] for q in c.quarantined] == ["node-3"] and c.quarantined[0]["reason"] == "sdc"
    (rejoined,) = [e.detail for e in c.events.of_kind("replica_rejoined")]
    assert rejoined["replicas"] == [1] and rejoined["source"] == 0, rejoined
    assert "node-3" not in c.placement.node_of_rank and "node-4" in c.placement.node_of_rank
    sums = [e.detail for e in c.events.of_kind("replica_checksums")]
    assert len(sums) == 4 and all(d["agree"] and d["replicas"] == [0, 1] for d in sums), sums
    assert [h["step"] for h in c.progress.history] == list(range(1, 41))
    check_cursor_accounting(tmp_path, "replica-sdc")


def test_every_replica_losing_a_node_falls_back_to_the_replicas_own_peer_snapshots(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """Peer snapshots on (every step), taken inside each replica. node-2 (replica 0's) and node-3
    (replica 1's) are killed at once: no replica is left to heal from, so the run takes the world
    path; three nodes are left, so it shrinks to one replica, which loads the last step from the
    copies its nodes kept of their lost partners' ranks (local ranks, the replica's own layout),
    reading nothing from the store, and finishes with every step once. (Replica 0 is placed on
    node-0 and node-2, replica 1 on node-1 and node-3: each stage in another rack.)"""
    s = replica_spec("replica-peers", tmp_path, steps=12, peer_every=1,
                     drills=[{"kind": "kill-node", "at_step": 6, "target": "node-2"},
                             {"kind": "kill-node", "at_step": 6, "target": "node-3"}])
    try:
        c = drive(s, ray_cluster)
    finally:
        restore_node(ray_cluster, "node-2")
        restore_node(ray_cluster, "node-3")
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    assert c.events.of_kind("attempt_started")[0].detail["placement"]["node"] == ("node-0", "node-2", "node-1", "node-3")
    started = [e.detail for e in c.events.of_kind("attempt_started")]
    assert len(started) == 2 and started[1]["dp_replicas"] == 1, started
    assert started[1]["restore_from"] == "peer", started[1].get("peer_unusable")
    assert started[1]["start_step"] >= 6, started[1]
    restored = [e.detail for e in c.events.of_kind("restored") if e.attempt == 1]
    assert len(restored) == 4 and all(d["source"] == "peer" and d["bytes_read"] == 0 for d in restored), restored
    assert all(d["how"] == "same mesh" and d["saved_on_mesh"] == {"dp": 1, "pp": 2, "tp": 2} for d in restored), restored
    drills = c.to_dict(0)["drills"]
    assert [r["restored_from"] for r in drills] == ["peer", "peer"], (drills, [(e.kind, e.detail) for e in c.events.view() if e.kind in ("failure_detected", "decision", "replica_lost")])
    assert [h["step"] for h in c.progress.history] == list(range(1, 13))
    check_cursor_accounting(tmp_path, "replica-peers")


def test_a_transient_collective_error_is_resolved_by_one_resync_epoch_and_changes_nothing(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """The collective-fault drill: rank 7's gradient reduce across replicas fails at step 6 with no
    node or process lost (a transient NCCL error). Every replica discards the step, the controller
    publishes an epoch of the same members at once (nothing is lost, so no probe finds a node), and
    the step is done again: one attempt, no failure, and the same losses, step for step, as the run
    without the fault (the reference: the same spec, no drill)."""
    clean = drive(replica_spec("replica-clean", tmp_path, drills=[], steps=10), ray_cluster)
    assert clean.state is RunState.SUCCEEDED, clean.error
    s = replica_spec("replica-resync", tmp_path, steps=10,
                     drills=[{"kind": "collective-fault", "at_step": 5, "target": "replica:1"}])
    c = drive(s, ray_cluster)
    assert c.state is RunState.SUCCEEDED, c.error
    assert len(c.events.of_kind("attempt_started")) == 1 and not c.events.of_kind("failure_detected")
    assert not c.events.of_kind("replica_lost"), "nothing was lost"
    (report,) = c.to_dict(0)["drills"]
    assert report["target"] == "7" and report["point"] == "reduce", report
    assert report["decision"] == "resync" and report["outcome"] == "recovered" and report["steps_lost"] == 0, report
    (resync,) = [e.detail for e in c.events.of_kind("replica_resync")]
    assert resync["step"] == 6, resync
    discarded = [e.detail for e in c.events.of_kind("replica_step_discarded")]
    # Each replica says it once, by its first rank: both discarded the step.
    assert {d["step"] for d in discarded} == {6} and sorted(d["rank"] for d in discarded) == [0, 4], discarded
    assert [h["step"] for h in c.progress.history] == list(range(1, 11))
    assert [h["loss"] for h in c.progress.history] == [h["loss"] for h in clean.progress.history], \
        "the step done again is not the step the fault discarded"
    sums = [e.detail for e in c.events.of_kind("replica_checksums")]
    assert sums and all(d["agree"] and d["replicas"] == [0, 1] for d in sums), sums
    check_cursor_accounting(tmp_path, "replica-resync")


def test_two_replicas_out_with_one_spare_one_forms_again_and_the_others_train_on(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """Item 8 (re-forming was all or nothing): four replicas of tp2, one node each, and one spare; the
    nodes of replicas 1 and 2 are killed at once after step 5. The spare takes one of them, which is
    formed again and rejoins; the other stays out, and the live replicas train on with its share of
    the batch skipped (batch_while_healing: shrink) to the end, in one attempt."""
    s = replica_spec("two-out", tmp_path, replicas=4, parallelism={"dp": 4, "pp": 1, "tp": 2},
                     elastic={"batch_while_healing": "shrink"}, steps=60,
                     drills=[{"kind": "kill-node", "at_step": 5, "target": "replica:1"},
                             {"kind": "kill-node", "at_step": 5, "target": "replica:2"}])
    try:
        c = drive(s, ray_cluster, on_tick=give_up_after(240.0))
    finally:
        restore_nodes(ray_cluster)
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    assert len(c.events.of_kind("attempt_started")) == 1, "the run stopped the world"
    lost = sorted(k for e in c.events.of_kind("replica_lost") for k in e.detail["replicas"])
    assert lost == [1, 2], lost
    rejoined = [k for e in c.events.of_kind("replica_rejoined") for k in e.detail["replicas"]]
    assert len(rejoined) == 1 and rejoined[0] in (1, 2), rejoined
    out = 3 - rejoined[0]
    skipped = [e.detail for e in c.events.of_kind("samples_skipped")]
    assert skipped and all(out in d["replicas"] for d in skipped), skipped
    assert c.placement is not None and "node-4" in c.placement.node_of_rank, "the spare was not used"
    assert [h["step"] for h in c.progress.history] == list(range(1, 61))
    sums = [e.detail for e in c.events.of_kind("replica_checksums")]
    assert sums and all(d["agree"] for d in sums), sums
    assert sorted(sums[-1]["replicas"]) == sorted({0, 1, 2, 3} - {out}), sums[-1]


def test_a_donor_killed_during_the_transfer_leaves_the_joiner_to_the_other_member(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """Item 4 at D = 3: three replicas of tp2, one node each. Replica 2's node is killed after step 4;
    replica 2 is formed again on the spare. When it joins, replica 0 (the first vouched member: the
    donor) holds its transfer back 12 s (a collective-fault drill at `sync` on its last rank), and its
    node is killed 4 s after the joiner's epoch came (the members switch at their next step's end).
    The joiner's cut-off transfer leaves it joining; replica 1, which received the bytes it held,
    gives them in the next epoch; replica 0 forms again on the idle node. One attempt, and at the end
    every replica holds the same bytes. (The dist test of the same race, against a float64 single
    process: tests/dist/test_replica_races.py.)"""
    s = replica_spec("donor-killed", tmp_path, replicas=3, parallelism={"dp": 3, "pp": 1, "tp": 2}, steps=60,
                     changes={"train": {"global_batch": 12}, "health": {"collective_timeout_s": 20, "hang_floor_s": 30}},
                     drills=[{"kind": "kill-node", "at_step": 4, "target": "replica:2"},
                             {"kind": "collective-fault", "at_step": 4, "target": "replica:0", "point": "sync",
                              "seconds": 12}])
    seen: dict[str, float] = {}

    def kill_the_donor_in_its_transfer(c: RunController) -> None:
        if "killed" in seen:
            return
        if "ready" not in seen and any(e.detail.get("replica") == 2 for e in c.events.of_kind("replica_ready")):
            seen["ready"] = time.time()
        if "ready" in seen and time.time() - seen["ready"] > 4.0:
            c.request_drill(time.time(), "kill-node", target="replica:0")
            seen["killed"] = time.time()

    try:
        c = drive(s, ray_cluster, on_tick=kill_the_donor_in_its_transfer)
    finally:
        restore_nodes(ray_cluster)
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    assert "killed" in seen, "the joiner never got ready"
    assert len(c.events.of_kind("attempt_started")) == 1, "the run stopped the world"
    lost = [sorted(e.detail["replicas"]) for e in c.events.of_kind("replica_lost")]
    assert lost == [[2], [0]], lost
    rejoins = {k: e.detail for e in c.events.of_kind("replica_rejoined") for k in e.detail["replicas"]}
    assert rejoins[2]["source"] == 1, rejoins
    assert 0 in rejoins, "replica 0 was not formed again"
    assert [h["step"] for h in c.progress.history] == list(range(1, 61))
    sums = [e.detail for e in c.events.of_kind("replica_checksums")]
    assert sums and all(d["agree"] for d in sums) and sorted(sums[-1]["replicas"]) == [0, 1, 2], sums


def test_a_bit_flipped_in_the_only_live_replica_while_the_other_forms_never_reaches_it(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """Item 2's single donor, at D = 2 after a loss: replica 1's node is killed after step 5 and, at
    the same step, a bit flips at rest in rank 3 (replica 0: the only live replica, the only donor
    replica 1 could be healed from). Replica 0's probes find it at its next step, before any
    transfer; no live replica is left to vouch for a state, so nothing is copied from it and the run
    goes back to a state from before the flip. The joiner never receives the flipped bit, and every
    replica ends with the same bytes."""
    s = replica_spec("flip-after-loss", tmp_path, steps=12,
                     drills=[{"kind": "kill-node", "at_step": 5, "target": "replica:1"},
                             {"kind": "bitflip", "at_step": 5, "target": "3"}])
    try:
        c = drive(s, ray_cluster)
    finally:
        restore_nodes(ray_cluster)
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    (flipped,) = [e for e in c.events.of_kind("drill_injected") if e.detail["drill"] == "bitflip"]
    suspects = c.events.of_kind("sdc_suspect")
    assert suspects and suspects[0].detail["ranks"] == [3], [e.detail for e in suspects]
    verdict = next(e for e in c.events.of_kind("failure_detected") if e.detail.get("cause") == "sdc")
    took = [e.detail for e in c.events.of_kind("replica_rejoined") if flipped.time <= e.time <= verdict.time]
    assert not took, f"a replica took the flipped state: {took}"
    started = [e.detail for e in c.events.of_kind("attempt_started")]
    assert len(started) == 2 and started[1]["start_step"] <= flipped.detail["step"], started
    assert [h["step"] for h in c.progress.history] == list(range(1, 13))
    # (The world path went on with one replica: no checksums to compare.) A flipped exponent bit that
    # reached any state would show in the loss: every step's is finite and below the first's.
    losses = [h["loss"] for h in c.progress.history]
    assert all(math.isfinite(x) and x < losses[0] for x in losses[1:]), losses


def test_a_drained_node_is_left_by_its_replica_only_which_forms_again_on_the_spare(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """A drain of node-3 (replica 1's) after step 6: replica 1 stops and forms again on the spare from
    replica 0's memory while replica 0 trains on; one attempt, no failure, node-3 never taken back."""
    s = replica_spec("replica-drain", tmp_path, drills=[], steps=60)
    asked: list[bool] = []

    def drain_after_6(c: RunController) -> None:
        if not asked and c.state is RunState.RUNNING and c.progress.step >= 6:
            asked.append(c.drain({"node-3"}, "drain of node-3"))

    c = drive(s, ray_cluster, on_tick=drain_after_6)
    print_timeline(c)
    assert c.state is RunState.SUCCEEDED, c.error
    assert asked == [True] and len(c.events.of_kind("attempt_started")) == 1, "the world never stopped"
    (drained,) = [e.detail for e in c.events.of_kind("drained")]
    assert drained["replicas"] == [1] and drained["kept"] == "replicas", drained
    assert not c.events.of_kind("failure_detected") and c.failures == [], "a drain is not a failure"
    (rejoined,) = [e.detail for e in c.events.of_kind("replica_rejoined")]
    assert rejoined["replicas"] == [1] and rejoined["source"] == 0, rejoined
    assert "node-3" not in c.placement.node_of_rank and "node-4" in c.placement.node_of_rank
    sums = [e.detail for e in c.events.of_kind("replica_checksums")]
    assert sums and all(d["agree"] for d in sums), sums
    assert [h["step"] for h in c.progress.history] == list(range(1, 61)), "every step once"
