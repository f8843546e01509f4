"""Health verdicts in the run controller: straggler events and replacement, SDC quarantine with a
rollback to a checkpoint committed before the corruption, and the new drills' spec fields."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from checkpointing.manifest import Manifest, commit, committed_steps
from checkpointing.store import LocalStore
from controller.run_state import RunState
from controller.spec import SpecError, parse_spec
from controller.state import RunController
from controller.topology import NodeState
from tests.unit.fakes import FakeReplicaGroup, FakeWorkerGroup, drive
from trainer.report import StepReport

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())


def make(tmp_path: Path | None = None, nodes: int = 5, spares: int = 1,
         **health: object) -> tuple[RunController, FakeWorkerGroup]:
    raw = copy.deepcopy(BASE)
    raw["drills"] = []
    raw["cluster"]["local"].update(nodes=nodes, spares=spares)
    raw["health"].update(health)
    spec = parse_spec(raw)
    group = FakeWorkerGroup()
    store = LocalStore(tmp_path) if tmp_path is not None else None
    c = RunController(spec, spec.topology(), group, now=100.0, checkpoint_store=store,
                      topology_source=spec.topology)
    drive(c, RunState.RUNNING)
    return c, group


def report_steps(g: FakeWorkerGroup, first: int, last: int, *, slow: dict[int, float] | None = None) -> None:
    """Every rank of the dp2 x pp2 x tp2 mesh reports each step; `slow`: rank -> compute factor."""
    attempt = g.started[-1].attempt
    for step in range(first, last + 1):
        for rank in range(8):
            last_stage = (rank // 2) % 2 == 1
            compute = 0.4 * (slow or {}).get(rank, 1.0)
            g._pending.reports.append(StepReport(  # noqa: SLF001 - the fake's queue
                rank=rank, attempt=attempt, step=step, cursor=step * 16, loss=1.0 / step if last_stage else None,
                step_time_s=0.8, data_s=0.0, compute_s=compute, wait_s=0.8 - compute, tokens_per_s=1.0))


def test_straggler_is_reported_with_rank_node_and_score_and_the_run_goes_on() -> None:
    c, g = make()
    report_steps(g, 1, 8)
    c.step(110.0)
    report_steps(g, 9, 30, slow={6: 1.8})
    assert c.step(111.0) is RunState.RUNNING, "report only (the default action)"
    (event,) = c.events.of_kind("straggler")
    assert event.detail["rank"] == 6 and event.detail["node"] == c.placement.node_of_rank[6]  # type: ignore[union-attr]
    assert event.detail["score"] == pytest.approx(1.8, rel=0.01) and event.detail["basis"] == "relative"
    assert 9 <= event.detail["step"] <= 20
    scores = {s["rank"]: s for s in c.to_dict(112.0)["health"]["scores"]}
    assert scores[6]["straggler"] and not any(s["straggler"] for r, s in scores.items() if r != 6)
    assert scores[0]["relative"] == pytest.approx(1.0)


@pytest.mark.parametrize("straggler_steps", [4, 10])
def test_straggler_steps_is_how_long_a_rank_must_stay_slow(straggler_steps: int) -> None:
    """A burst: rank 6 computes 1.45x its peers' time for 8 steps, then as they do (shared cores, a
    noisy neighbour). At the default 4 steps in a row that is a straggler; at 10 it is not, and a
    rank that stays 1.5x slow is still flagged, 10 evaluations after its window's median turns."""
    c, g = make(straggler_ratio=1.3, straggler_steps=straggler_steps)
    report_steps(g, 1, 20)
    report_steps(g, 21, 28, slow={6: 1.45})
    report_steps(g, 29, 50)
    c.step(110.0)
    burst = [e.detail["rank"] for e in c.events.of_kind("straggler")]
    assert burst == ([6] if straggler_steps == 4 else [])
    report_steps(g, 51, 80, slow={2: 1.5})
    c.step(111.0)
    (stays,) = [e.detail for e in c.events.of_kind("straggler") if e.detail["step"] > 50]
    assert stays["rank"] == 2 and stays["score"] == pytest.approx(1.5, rel=0.01)
    assert stays["step"] == 50 + 3 + straggler_steps - 1, "the window's median turns at its 3rd slow step"


def test_straggler_replace_moves_the_node_to_a_spare_at_the_next_checkpoint() -> None:
    c, g = make(straggler_action="replace")
    report_steps(g, 1, 30, slow={3: 2.0})
    assert c.step(110.0) is RunState.RUNNING, "waits for a checkpoint: no step is thrown away"
    g.emit(0, "checkpoint_committed", step=30, seconds=0.1)
    assert c.step(111.0) is RunState.LAUNCHING
    detected = c.events.of_kind("failure_detected")[-1].detail
    assert detected["cause"] == "straggler" and detected["ranks"] == [3]
    slow_node = c.events.of_kind("straggler")[0].detail["node"]
    assert c.events.of_kind("decision")[-1].detail["action"] == "replace"
    assert c.topology.node(slow_node).state is NodeState.QUARANTINED
    assert c.to_dict(112.0)["quarantined"][0]["node"] == slow_node
    c.step(112.0)
    assert slow_node not in g.started[-1].placement.node_of_rank


def commit_step(store: LocalStore, run_id: str, step: int) -> None:
    commit(store, Manifest(run_id=run_id, step=step, attempt=0, mesh={"dp": 2, "pp": 2, "tp": 2}, world_size=8,
                           cursor=step * 16, seeds={"data": 0, "init": 0}))


def test_sdc_suspect_quarantines_the_node_and_rolls_back_before_the_corruption(tmp_path: Path) -> None:
    c, g = make(tmp_path)
    for step in (10, 15, 20):
        commit_step(c.checkpoints.store, "tiny-gpt", step)  # type: ignore[arg-type]
    report_steps(g, 1, 22)
    node = c.placement.node_of_rank[5]  # type: ignore[union-attr]
    g.emit(0, "sdc_suspect", step=23, check="periodic", ranks=[5], clean_through_step=14,
           evidence={"5": ["replica fingerprint differs from the majority"]})
    g.error_worker(5, "SilentDataCorruption: suspected on ranks [5]")
    assert c.step(120.0) is RunState.LAUNCHING, "the probes' verdict needs no grace period"
    detected = c.events.of_kind("failure_detected")[-1].detail
    assert detected["cause"] == "sdc" and detected["ranks"] == [5] and detected["nodes"] == [node]
    (quarantined,) = c.events.of_kind("quarantined")
    assert quarantined.detail["reason"] == "sdc" and "replica fingerprint" in str(quarantined.detail["evidence"])
    c.step(121.0)
    attempt = g.started[-1]
    assert attempt.resume_step == 10, "the newest commit before the corruption could start, not the latest (20)"
    assert committed_steps(c.checkpoints.store, "tiny-gpt") == [10]  # type: ignore[arg-type]
    assert [e.detail["step"] for e in c.events.of_kind("checkpoint_discarded")] == [15, 20]
    assert node not in attempt.placement.node_of_rank
    run = c.to_dict(122.0)
    assert [q["node"] for q in run["quarantined"]] == [node]


def test_an_sdc_rollback_the_store_cannot_take_now_is_done_before_the_next_launch(tmp_path: Path) -> None:
    """The store is down when the SDC verdict arrives: the run neither fails nor launches; once the
    store answers, the suspect steps are discarded first and the attempt loads the clean one."""
    from tests.unit.fakes import FlakyStore

    c, g = make(tmp_path)
    store = FlakyStore(c.checkpoints.store)
    c.checkpoints.store = store  # type: ignore[assignment]
    for step in (10, 15, 20):
        commit_step(store.inner, "tiny-gpt", step)
    report_steps(g, 1, 22)
    g.emit(0, "sdc_suspect", step=23, check="periodic", ranks=[5], clean_through_step=14, evidence={})
    store.down = True
    started = len(g.started)
    for t in range(120, 200):
        c.step(float(t))
    assert c.state is RunState.LAUNCHING and len(g.started) == started and c.error is None
    assert not c.events.of_kind("checkpoint_discarded")
    store.down = False
    drive(c, RunState.RUNNING, t=240.0)
    assert g.started[-1].resume_step == 10
    assert [e.detail["step"] for e in c.events.of_kind("checkpoint_discarded")] == [15, 20]


def test_quarantined_node_never_comes_back() -> None:
    c, g = make(nodes=4, spares=0)
    node = c.placement.node_of_rank[0]  # type: ignore[union-attr]
    g.emit(0, "sdc_suspect", step=3, check="anomaly", ranks=[0], clean_through_step=2, evidence={})
    c.step(120.0)
    t = 121.0
    while c.state is not RunState.RUNNING and not c.state.terminal:
        c.step(t)
        t += 1
    assert c.config is not None and c.config.mesh.dp == 1, "no spare: shrink"
    g.emit(0, "checkpoint_committed", step=4, seconds=0.1)  # lost nodes would grow back here
    c.step(t + 1)
    assert c.topology.node(node).state is NodeState.QUARANTINED
    assert [d.detail["action"] for d in c.events.of_kind("decision")] == ["shrink"]


def test_drill_targets_may_be_ints_and_parameters_must_fit_the_kind() -> None:
    raw = copy.deepcopy(BASE)
    raw["drills"] = [{"kind": "slow-rank", "at_step": 3, "target": 2, "factor": 2.0},
                     {"kind": "storage-outage", "at_step": 4, "seconds": 5}]
    spec = parse_spec(raw)
    assert spec.drills[0].target == "2" and spec.drills[0].factor == 2.0
    raw["drills"] = [{"kind": "kill-node", "at_step": 3, "factor": 2.0}]
    with pytest.raises(SpecError, match="factor is for slow-rank drills"):
        parse_spec(raw)
    raw["drills"] = [{"kind": "slow-rank", "at_step": 3, "factor": 0.5}]
    with pytest.raises(SpecError, match="factor"):
        parse_spec(raw)


def test_replicas_that_end_with_different_states_do_not_end_the_run_succeeded(tmp_path: Path) -> None:
    """Issue 44, item 7: `replica_checksums` had no consumer: a run could end `succeeded` with replicas
    that disagree. The last comparison says replica 1's final state differs from replicas 0 and 2's:
    an SDC, not contained (replica 0 saved the final step, but which saved is not trusted), the
    ranks at that position of the odd replica named, and the run goes back to the last step they
    agreed on instead of succeeding."""
    c, g = make(tmp_path)
    for step in (10, 20, 30):
        commit_step(c.checkpoints.store, "tiny-gpt", step)  # type: ignore[arg-type]
    report_steps(g, 1, 30)
    c.step(110.0)
    g.emit(0, "replica_checksums", position=1, step=30, replicas=[0, 1, 2], checksums=[7, 9, 7], ranks=[1, 5, 9],
           agreed_step=24, agree=False)
    g.complete()
    assert c.step(111.0) is not RunState.SUCCEEDED
    detected = c.events.of_kind("failure_detected")[-1].detail
    assert detected["cause"] == "sdc" and detected["ranks"] == [5]
    t = 112.0
    while c.state is not RunState.RUNNING:
        c.step(t)
        t += 1
    assert g.started[-1].resume_step == 20, "the newest commit at or before the last agreed step (24)"
    assert committed_steps(c.checkpoints.store, "tiny-gpt") == [10, 20]  # type: ignore[arg-type]


def test_a_drill_may_target_a_replica() -> None:
    """Issue 44: `--target replica:K` hits the replica's last rank (a rank drill) or that rank's node (a
    node drill); a replica the attempt does not have is refused with the ones it has."""
    from controller.drills import DrillError, DrillKind, concrete_target, target_problem
    from controller.spec import load_spec

    spec = load_spec(ROOT / "examples" / "tiny-gpt-replicas.yaml")
    c = RunController(spec, spec.topology(), FakeReplicaGroup(), now=100.0, topology_source=spec.topology)
    t = drive(c, RunState.RUNNING)
    placement = c.placement
    assert placement is not None and placement.mesh.dp_replicas == 2 and placement.mesh.world_size == 8
    assert concrete_target(DrillKind.KILL_RANK, "replica:0", placement) == "3"
    assert concrete_target(DrillKind.KILL_NODE, "replica:1", placement) == placement.node_of_rank[7]
    assert concrete_target(DrillKind.KILL_NODE, "replica:0", placement) == placement.node_of_rank[3]
    assert target_problem(DrillKind.KILL_NODE, "replica:1", placement) is None
    assert "replica:0 to replica:1" in (target_problem(DrillKind.KILL_RANK, "replica:2", placement) or "")
    assert c.request_drill(t, "kill-node", target="replica:1").target == "replica:1"
    with pytest.raises(DrillError, match="replica:0 to replica:1"):
        c.request_drill(t, "kill-rank", target="replica:9")
