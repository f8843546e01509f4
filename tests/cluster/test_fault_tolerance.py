"""Fault tolerance on a real local Ray cluster with real process kills: a node's raylet SIGKILLed
(with and without a spare), a worker SIGKILLed, a worker SIGSTOPped; detection, attribution,
re-mesh, resume, growth back, and bit-identical weights after a same-mesh recovery."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import pytest
import torch

from checkpointing.manifest import committed_steps, read_manifest
from checkpointing.store import open_store
from controller.placement import recorded_nodes
from controller.ray.cluster import LocalRayCluster
from controller.drill_reports import FINAL_OUTCOMES
from controller.drills import DrillInjector, DrillKind
from controller.ray.runner import drive, spec_view
from controller.run_state import RunState
from controller.spec import RunSpec, checkpoint_store, parse_spec
from controller.state import RunController
from controller.topology import Topology
from tests.dist.harness import run_ranks
from tests.dist.reshard import load_on_mesh
from trainer.config import MeshShape, config_to_dict

pytestmark = pytest.mark.cluster

GLOBAL_BATCH = 8
MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 64, "seq_len": 32}
"""One block per pipeline stage: on 2 cores a step's cost is torch's per-op overhead (DTensor dispatch,
the schedule, gloo), which each block adds to; what these tests check (decisions, restores, resharding
onto the same or another mesh, bit-identity) does not depend on depth."""


def spec(name: str, root: Path, *, nodes: int, spares: int, drills: list[dict], steps: int = 16,
         every: int = 4, elastic: dict | None = None, peer_every: int = 0, tp: int = 2) -> RunSpec:
    return parse_spec({
        "elastic": elastic or {},
        "name": name,
        "model": MODEL,
        "data": {"kind": "synthetic", "seed": 0},
        "train": {"steps": steps, "global_batch": GLOBAL_BATCH, "micro_batch": 2, "lr": 1e-2},
        "parallelism": {"dp": 2, "pp": 2, "tp": tp},
        "cluster": {"local": {"nodes": nodes, "gpus_per_node": 2, "racks": 2, "spares": spares}},
        "checkpoint": {"uri": f"file://{root}", "every_steps": every, "keep": 10, "peer_every_steps": peer_every},
        "health": {"collective_timeout_s": 6, "hang_floor_s": 10},
        "drills": drills,
    })


def restore_node(cluster: LocalRayCluster, name: str) -> None:
    if name not in cluster._nodes:  # noqa: SLF001 - the test owns the fixture cluster
        cluster.add_node(int(name.split("-")[1]))


def final_state(root: Path, run_id: str, step: int) -> dict[str, torch.Tensor]:
    """The committed step reassembled on one process (resharding is bit-identical, tested elsewhere)."""
    from trainer.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig

    cfg = TrainerConfig(model=ModelConfig(**MODEL),
                        data=DataConfig(seed=0), train=TrainConfig(steps=16, global_batch=GLOBAL_BATCH,
                                                                    micro_batch=2, lr=1e-2, dtype="float32"),
                        mesh=MeshShape())
    (result,) = run_ranks(load_on_mesh, 1, config=config_to_dict(cfg), uri=f"file://{root}", step=step,
                          run_id=run_id)
    return result["state"]


def check_cursor_accounting(root: Path, run_id: str) -> None:
    """Every committed step's data cursor is step x global batch: no sample skipped or repeated,
    whatever the dp degree that wrote it (the split per dp is checked in tests/unit/test_data.py)."""
    store = open_store(f"file://{root}")
    for step in committed_steps(store, run_id):
        assert read_manifest(store, run_id, step).cursor == step * GLOBAL_BATCH


def simulator_agrees(spec_: RunSpec, real: RunController) -> None:
    """`goodput simulate` of the same spec and the same scripted failure, with the cost model set to
    what this real run measured (step time, save stall, detection, restart), takes the same
    decisions, loses the same steps and puts its badput in the same categories."""
    import statistics

    from controller.sim.run import run_view, simulate

    g = real.goodput(real.finished_at or 0.0)
    (failure,) = g["failures"]
    events = [e.to_dict() for e in real.events]
    stalls = [e["detail"]["blocked_s"] for e in events if e["kind"] == "checkpoint_staged"]
    # (a commit's seconds are its stall and its save, as the simulator's are; a save of a fixed 0.5 s
    # was longer than two steps of this model once they took 0.2 s: the step-4 checkpoint was not
    # committed when the simulated node died, and the simulator lost 6 steps to the real run's 2)
    commits = [e["detail"]["seconds"] for e in events if e["kind"] == "checkpoint_committed" and "seconds" in e["detail"]]
    raw = spec_.model_dump(mode="json")
    local = raw["cluster"].pop("local")
    raw["cluster"] = {"simulated": local}
    raw["failures"] = {"rates": {"gpu": 0, "host": 0, "network": 0, "storage": 0, "software": 0}}
    # The same failure at the same step: the real controller injects a drill when it hears of its step,
    # a poll after it ends (a step or two later where steps are short); the simulator hears at once.
    (real_drill,) = real.to_dict(0)["drills"]
    raw["drills"][0]["at_step"] = real_drill["at_step"]
    raw["cost"] = {"step_s": statistics.median(real.progress.step_times), "restart_s": failure["recovery_seconds"],
                   "restore_s": 0.0, "node_loss_detection_s": failure["detection_seconds"],
                   "checkpoint_stall_s": statistics.mean(stalls),
                   "checkpoint_save_s": max(0.0, statistics.mean(commits) - statistics.mean(stalls))}
    sim = simulate(parse_spec(raw), days=1)
    assert sim["state"] == "succeeded" and sim["steps"] == real.progress.step
    real_decisions = [e["detail"]["action"] for e in events if e["kind"] == "decision"]
    assert sim["decisions"] == {a: real_decisions.count(a) for a in real_decisions}
    assert sim["failures_by_cause"] == {"node_lost": 1} and sim["attempts"] == max(real.attempt, 0) + 1
    (sim_drill,) = run_view(sim)["drills"]
    assert sim_drill["steps_lost"] == real_drill["steps_lost"] and sim_drill["decision"] == real_drill["decision"]
    real_b, sim_b, step_s = g["badput_seconds"], sim["goodput"]["badput_seconds"], raw["cost"]["step_s"]
    # Detection and restart were given this run's own latencies: the same seconds, within one step and
    # 0.25 s (a real survivor may finish a step inside the detection window: that time counts as
    # recomputation there, as detection in the simulator).
    for category in ("failure_detection", "restart_restore"):
        assert sim_b[category] == pytest.approx(real_b[category], abs=step_s + 0.25), (category, real_b, sim_b)
    # The simulator loses exactly the drill's steps since the commit, each at the median step time. The
    # real run loses the same executions (their own spans, recomputed here from the progress record:
    # right after a commit they overlap the background upload and run slower than the median on a busy
    # 2-core machine) and the step in flight when the drill struck: at least 80 % of the simulator's, at
    # most the lost spans plus one step and a poll.
    assert sim_b["recomputation"] == pytest.approx(real_drill["steps_lost"] * step_s)
    failed = failure["attempt"]
    resumed = next(e["detail"]["start_step"] for e in events if e["kind"] == "attempt_started"
                   and e["attempt"] > failed)
    lost = [s for s in real.progress.spans if s.attempt == failed and s.step > resumed]
    assert len(lost) >= real_drill["steps_lost"], (lost, real_drill)
    lost_s = sum(s.end - s.start for s in lost)
    in_flight = max([step_s] + [s.end - s.start for s in lost])
    assert 0.8 * sim_b["recomputation"] <= real_b["recomputation"] <= lost_s + in_flight + 0.5, (
        real_b, sim_b, lost_s)


def test_kill_node_with_spare_same_mesh_bit_identical(ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """From the store (the step-8 checkpoint) and from peers (the step-6 snapshots in the nodes'
    memory), a kill-node recovery on the same mesh ends with the uninterrupted run's weights. (The
    store's run saves every 8 steps and loses its node after step 14: on 2 cores a save takes 0.5-1.0
    s, 3-5 of these steps, and the step-8 checkpoint must be committed when the node goes, the
    step-16 one not yet. With a save every 4 and the loss after step 7, the step-4 commit came only
    0.2-0.5 s before the loss, and a make test once resumed from step 0.)"""
    faulty = spec("spare", tmp_path, nodes=5, spares=1, steps=24, every=8,
                  drills=[{"kind": "kill-node", "at_step": 14}])
    try:
        c = drive(faulty, ray_cluster)
    finally:
        restore_node(ray_cluster, "node-3")
    assert c.state is RunState.SUCCEEDED, c.error
    assert c.progress.step == 24
    (report,) = c.to_dict(0)["drills"]
    assert report["cause"] == "node_lost" and report["attributed_to"]["nodes"] == ["node-3"]
    assert report["decision"] == "replace" and report["outcome"] == "recovered"
    assert report["detection_s"] < 5.0, f"node loss detected in {report['detection_s']:.1f} s"
    attempts = c.events.of_kind("attempt_started")
    assert attempts[0].detail["mesh"] == attempts[1].detail["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
    assert "node-4" in recorded_nodes(attempts[1].detail["placement"])
    assert attempts[1].detail["start_step"] == 8
    check_cursor_accounting(tmp_path, "spare")
    simulator_agrees(faulty, c)

    healing = spec("healed", tmp_path, nodes=5, spares=1, drills=[{"kind": "kill-node", "at_step": 6}], peer_every=1)
    try:
        h = drive(healing, ray_cluster)
    finally:
        restore_node(ray_cluster, "node-3")
    assert h.state is RunState.SUCCEEDED, h.error
    (report,) = h.to_dict(0)["drills"]
    attempts = h.events.of_kind("attempt_started")
    why = attempts[-1].detail.get("peer_unusable")
    assert report["decision"] == "replace" and report["restored_from"] == "peer", f"not from peers: {why}"
    assert report["steps_lost"] <= 1, report
    assert attempts[1].detail["restore_from"] == "peer" and attempts[1].detail["start_step"] >= 6
    restored = [e.detail for e in h.events.of_kind("restored")]
    # One recovery: 8 ranks restored once. If an attempt after it failed too, say why (seen once, cause unknown).
    followed = [(e.attempt, e.detail) for e in h.events.of_kind("failure_detected") + h.events.of_kind("decision")]
    assert len(restored) == 8, (len(restored), followed)
    assert all(d["source"] == "peer" and d["bytes_read"] == 0 for d in restored), restored
    assert restored[0]["how"] == "same mesh" and restored[0]["bytes_from_peers"] > 0, restored[0]
    (memory, later) = [e.detail for e in h.events.of_kind("peer_snapshots")]
    assert 3.9 <= memory["max_host_per_state"] <= 4.1 and later["step"] > memory["step"]  # two slots, two copies
    check_cursor_accounting(tmp_path, "healed")
    # Survivors whose collective failed when the node went trained the next attempt in place (no
    # fork); the spare's ranks are fresh processes.
    kept = {name: [d["in_place"] for d in (e.detail for e in run.events.of_kind("restored") if e.attempt == 1)]
            for name, run in (("store", c), ("peers", h))}
    assert all(len(flags) == 8 and sum(flags) <= 6 for flags in kept.values()), kept  # 2 ranks were on node-3
    assert any(any(flags) for flags in kept.values()), kept

    straight = drive(spec("straight", tmp_path, nodes=5, spares=1, drills=[]), ray_cluster)
    assert straight.state is RunState.SUCCEEDED
    b = final_state(tmp_path, "straight", 16)
    for run in ("spare", "healed"):  # (the store's run goes on to 24: a constant lr, so step 16 is the same)
        a = final_state(tmp_path, run, 16)
        assert set(a) == set(b)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{run}: {key} differs from the uninterrupted run"


def test_a_node_and_its_buddy_lost_together_fall_back_to_the_store(ray_cluster: LocalRayCluster,
                                                                   tmp_path: Path) -> None:
    """Two kill-node drills at one step: node-3 (dp1's last stage) and node-2 (dp0's), which keeps
    node-3's ranks' copies (and node-3 its). Stage 1's state survives in no memory: the run loads
    the step-8 checkpoint, says why not from peers, shrinks to dp1 and finishes. (A save every 8 and
    the loss after step 14, as in test_kill_node_with_spare_same_mesh_bit_identical: with a save
    every 4 and the loss after 6, a make test found the step-4 save uncommitted.)"""
    s = spec("buddies", tmp_path, nodes=5, spares=1, steps=18, every=8, peer_every=1,
             drills=[{"kind": "kill-node", "at_step": 14, "target": "node-3"},
                     {"kind": "kill-node", "at_step": 14, "target": "node-2"}])
    try:
        c = drive(s, ray_cluster)
    finally:
        restore_node(ray_cluster, "node-3")
        restore_node(ray_cluster, "node-2")
    assert c.state is RunState.SUCCEEDED, c.error
    failures = [e.detail for e in c.events.of_kind("failure_detected")]
    assert len(failures) == 1, failures
    (first,) = failures
    assert sorted(first["nodes"]) == ["node-2", "node-3"], first
    started = c.events.of_kind("attempt_started")[1].detail
    assert started["restore_from"] == "store" and started["start_step"] == 8, started
    assert "rank(s)" in started["peer_unusable"], started
    restored = [e.detail for e in c.events.of_kind("restored")]
    assert restored and all(d["source"] == "store" and d["bytes_read"] > 0 for d in restored)
    assert [r["restored_from"] for r in c.to_dict(0)["drills"]] == ["store", "store"]
    check_cursor_accounting(tmp_path, "buddies")


def test_kill_node_without_spare_shrinks_then_grows_back(ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    s = spec("shrink", tmp_path, nodes=4, spares=0, steps=32, drills=[{"kind": "kill-node", "at_step": 6}])
    readded: list[str] = []

    def bring_node_back(c: RunController) -> None:
        shrunk = c.config is not None and c.config.mesh.dp == 1
        if shrunk and not readded and c.attempt_steps() >= 1:
            ray_cluster.add_node(3)
            readded.append("node-3")

    try:
        c = drive(s, ray_cluster, on_tick=bring_node_back)
    finally:
        restore_node(ray_cluster, "node-3")
    assert c.state is RunState.SUCCEEDED, c.error
    decisions = [e.detail for e in c.events.of_kind("decision")]
    assert [d["action"] for d in decisions] == ["shrink", "grow"]
    assert decisions[0]["mesh"] == {"dp": 1, "pp": 2, "tp": 2} and decisions[1]["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
    attempts = c.events.of_kind("attempt_started")
    assert [a.detail["mesh"]["dp"] for a in attempts] == [2, 1, 2]
    shrunk_attempt = attempts[1].detail
    assert shrunk_attempt["start_step"] == 4 and "node-3" not in recorded_nodes(shrunk_attempt["placement"])
    history = c.progress.history
    assert [h["step"] for h in history] == list(range(1, 33)), "the loss history continues step by step"
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    check_cursor_accounting(tmp_path, "shrink")
    restored = [e.detail for e in c.events.of_kind("restored")]
    assert {d["saved_on_mesh"]["dp"] for d in restored} == {1, 2}, "resharded across dp changes both ways"


def test_below_min_dp_waits_for_capacity_then_resumes_on_the_full_mesh(ray_cluster: LocalRayCluster,
                                                                       tmp_path: Path) -> None:
    s = spec("wait", tmp_path, nodes=4, spares=0, steps=12, drills=[{"kind": "kill-node", "at_step": 5}],
             elastic={"min_dp": 2, "wait_for_capacity_s": 120})
    readded: list[str] = []

    def node_comes_back_while_waiting(c: RunController) -> None:
        if c.state is RunState.RECOVERING and not readded:
            ray_cluster.add_node(3)
            readded.append("node-3")

    try:
        c = drive(s, ray_cluster, on_tick=node_comes_back_while_waiting)
    finally:
        restore_node(ray_cluster, "node-3")
    assert c.state is RunState.SUCCEEDED, c.error
    decisions = [e.detail for e in c.events.of_kind("decision")]
    assert [d["action"] for d in decisions] == ["wait", "grow"], decisions
    assert "elastic.min_dp = 2" in decisions[0]["reason"] and decisions[0]["mesh"] is None
    assert decisions[1]["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
    attempts = c.events.of_kind("attempt_started")
    assert [a.detail["mesh"]["dp"] for a in attempts] == [2, 2], "never ran below min_dp"
    assert "node-3" in recorded_nodes(attempts[1].detail["placement"])
    assert c.progress.step == 12
    check_cursor_accounting(tmp_path, "wait")


@pytest.mark.parametrize("kind, cause", [("kill-rank", "rank_died"), ("hang-rank", "hang")])
def test_rank_failures_are_attributed_and_recovered(ray_cluster: LocalRayCluster, tmp_path: Path,
                                                    kind: str, cause: str) -> None:
    s = spec(kind, tmp_path, nodes=4, spares=0, steps=12, drills=[{"kind": kind, "at_step": 5, "target": "5"}])
    c = drive(s, ray_cluster)
    assert c.state is RunState.SUCCEEDED, c.error
    (report,) = c.to_dict(0)["drills"]
    assert report["cause"] == cause, report
    assert report["attributed_to"]["ranks"] == [5], "the rank that failed, not the survivors that noticed"
    assert report["decision"] == "restart" and report["outcome"] == "recovered"
    if kind == "hang-rank":
        assert report["detection_s"] < 6 + 10, "detected before the hang floor passed"
    assert c.progress.step == 12


class KillAtRandomOffsets:
    """A drill injector that kills a random node of the attempt's placement a random fraction of a
    step after the drill was due: anywhere in the next step and its snapshot exchange."""

    def __init__(self, inner: DrillInjector, seed: int) -> None:
        self.inner = inner
        self.arms_ahead = inner.arms_ahead
        self.rng = random.Random(seed)
        self.controller: RunController | None = None
        self.offsets: list[float] = []

    def inject(self, kind: DrillKind, target: str, **params: float | None) -> dict:
        assert self.controller is not None and self.controller.placement is not None
        target = self.rng.choice(sorted(set(self.controller.placement.node_of_rank)))
        step_s = statistics.median(list(self.controller.progress.step_times)[-5:] or [0.3])
        self.offsets.append(self.rng.uniform(0.0, 1.5) * step_s)
        time.sleep(self.offsets[-1])
        return self.inner.inject(kind, target, **params)


def test_twenty_kill_node_drills_at_random_offsets_all_heal_from_peers(ray_cluster: LocalRayCluster,
                                                                        tmp_path: Path) -> None:
    """dp2 x pp2 on two of the five nodes. A node of the attempt (either) is killed 20 times, each a
    random fraction of a step into the attempt's third step or later; a killed node comes back 5 s
    later (repaired, as goodput serve repairs) and an idle node takes the lost one's place. Every
    recovery loads from the peers' memory (never from the store, which holds no checkpoint before
    the last step), and no step the controller heard of is ever redone."""
    from controller.ray.drills import RayDrillInjector
    from controller.ray.worker_group import RayWorkerGroup

    s = spec("random-kills", tmp_path, nodes=5, spares=0, steps=1000, every=1000, peer_every=1, drills=[],
             elastic={"max_failures": 25}, tp=1)
    group = RayWorkerGroup(collective_timeout_s=s.health.collective_timeout_s)

    def topology(within_s: float | None = None) -> Topology:
        return spec_view(ray_cluster.topology(within_s), s)

    injector = KillAtRandomOffsets(RayDrillInjector(ray_cluster, group), seed=20261126)
    c = RunController(s, topology(), group, now=time.time(), checkpoint_store=checkpoint_store(s),
                      injector=injector, topology_source=topology)
    injector.controller = c
    ray_cluster.repair_after_s = 5.0
    requested = 0
    try:
        while not c.step(time.time()).terminal:
            ray_cluster.repair_due()
            ended = [r for r in c.drill_reports() if r["outcome"] in FINAL_OUTCOMES]
            idle = c.placement is not None and bool(topology().names - set(c.placement.node_of_rank))
            if len(ended) == 20:
                c.cancel()  # 20 recoveries: enough
            elif requested == len(ended) and c.state is RunState.RUNNING and c.attempt_steps() >= 2 and idle:
                c.request_drill(time.time(), "kill-node")
                requested += 1
            time.sleep(0.1)
    finally:
        group.close()
        ray_cluster.repair_after_s = None
        for n in range(5):
            restore_node(ray_cluster, f"node-{n}")
    reports = c.to_dict(0)["drills"]
    seen = "; ".join(f"step {r['at_step']}: {r['outcome']} {r.get('error') or ''} {r.get('cause')} "
                     f"{r.get('decision')} from {r.get('restored_from')}, {r.get('steps_lost')} lost" for r in reports)
    why = [a.detail.get("peer_unusable") for a in c.events.of_kind("attempt_started")]
    healed = (c.state is RunState.CANCELLED and len(reports) == 20
              and all(r["outcome"] == "recovered" for r in reports)
              and [r["restored_from"] for r in reports] == ["peer"] * 20
              and [r["steps_lost"] for r in reports] == [0] * 20)
    if not healed:  # what happened, for a failure seen only in CI (a drill's report alone does not say why)
        t0 = c.events.since(0)[0].time
        for e in c.events.since(0):
            if e.kind not in ("checkpoint_interval", "peer_snapshots"):
                print(f"{e.time - t0:7.1f} a{e.attempt} {e.kind} {json.dumps(e.detail, default=str)[:600]}")
        for report in reports:
            print(json.dumps(report, default=str)[:600])
    assert c.state is RunState.CANCELLED, (c.error, c.progress.step, requested, seen)
    assert len(reports) == 20 and all(r["outcome"] == "recovered" for r in reports), seen
    assert [r["restored_from"] for r in reports] == ["peer"] * 20, (why, injector.offsets, seen)
    assert [r["steps_lost"] for r in reports] == [0] * 20, (injector.offsets, seen)
    assert {a.detail["mesh"]["dp"] for a in c.events.of_kind("attempt_started")} == {2}, "never shrank"
