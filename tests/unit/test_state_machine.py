"""The run controller driven one step at a time with a fake worker group."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from controller.errors import ClusterSilent
from controller.run_state import RunState
from controller.spec import parse_spec
from controller.topology import Topology
from controller.state import RunController
from controller.attribution import ATTRIBUTION_GRACE_S
from tests.unit.fakes import FakeInjector, FakeWorkerGroup, drive

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())


def controller(raw: dict | None = None, group: FakeWorkerGroup | None = None) -> tuple[RunController, FakeWorkerGroup]:
    spec = parse_spec(raw or BASE)
    group = group or FakeWorkerGroup()
    return RunController(spec, spec.topology(), group, now=100.0), group


def test_happy_path_state_by_state() -> None:
    c, g = controller()
    assert c.state is RunState.PENDING
    assert c.step(101.0) is RunState.PLANNING
    assert c.step(102.0) is RunState.LAUNCHING
    assert c.plan is not None and c.plan.mesh.world_size == 8
    assert c.step(103.0) is RunState.RUNNING
    assert len(g.started) == 1 and g.started[0].attempt == 0 and g.started[0].resume_step is None
    g.finish_steps(1, 5)
    assert c.step(104.0) is RunState.RUNNING
    assert c.to_dict(104.0)["step"] == 5
    g.finish_steps(6, 30)
    g.complete()
    assert c.step(120.0) is RunState.SUCCEEDED
    assert g.shutdowns == 1
    assert c.events.kinds() == ["submitted", "planned", "attempt_started", "succeeded"]
    times = [e.time for e in c.events]
    assert times == sorted(times)
    run = c.to_dict(120.0)
    assert run["state"] == "succeeded" and run["finished_at"] == 120.0 and run["error"] is None
    assert [h["step"] for h in run["history"]] == list(range(1, 31))
    assert 0 < run["goodput"]["ettr"] <= 1
    assert {r["rank"] for r in run["placement"]} == set(range(8))
    assert c.step(130.0) is RunState.SUCCEEDED, "terminal states do not move"


def start_running(c: RunController) -> None:
    drive(c, RunState.RUNNING)


def test_worker_error_restarts_after_attribution_grace() -> None:
    c, g = controller()
    start_running(c)
    g.finish_steps(1, 2)
    g.error_worker(3, "Traceback...\nValueError: bad token id 999")
    g.error_worker(5, "Traceback...\nRuntimeError: [gloo] Connection closed by peer")
    assert c.step(110.0) is RunState.RUNNING, "held for the grace period: a node death may explain it"
    assert c.step(110.0 + ATTRIBUTION_GRACE_S) is RunState.LAUNCHING
    detected = c.events.of_kind("failure_detected")[0].detail
    assert detected["cause"] == "worker_error" and detected["ranks"] == [3]
    assert "ValueError: bad token id 999" in detected["message"]
    assert c.events.of_kind("decision")[0].detail["action"] == "restart"
    assert c.step(120.0) is RunState.RUNNING and g.started[-1].attempt == 1
    assert g.started[-1].mtbf_s == 20.0, "Young/Daly uses the run's observed MTBF after a failure"


def test_every_rank_ending_during_the_grace_period_is_not_success() -> None:
    """The failure cascade can end every survivor before the cause is known: still a failure."""
    c, g = controller()
    start_running(c)
    g.finish_steps(1, 2)
    g.error_worker(5, "RuntimeError: [gloo] Connection closed by peer")
    c.step(110.0)
    g.complete()  # the group says every rank has ended
    assert c.step(111.0) is RunState.RUNNING
    assert c.step(110.0 + ATTRIBUTION_GRACE_S) is RunState.LAUNCHING
    assert "succeeded" not in c.events.kinds()


def test_process_death_on_a_live_node_restarts_without_grace() -> None:
    c, g = controller()
    start_running(c)
    g.finish_steps(1, 2)
    g.kill_rank(5)
    g._pending.on_live_nodes.add(5)  # noqa: SLF001 - what the Ray group reports for a killed fork
    assert c.step(110.0) is RunState.LAUNCHING
    assert c.events.of_kind("failure_detected")[0].detail["ranks"] == [5]


def test_failure_budget_ends_the_run() -> None:
    raw = copy.deepcopy(BASE)
    raw["elastic"]["max_failures"] = 1
    c, g = controller(raw)
    t = 100.0
    for _ in range(2):
        start_running(c)
        g.finish_steps(1, 2)
        g.kill_rank(1)
        while c.state is RunState.RUNNING:
            t += 1.0
            c.step(t)
    assert c.state is RunState.FAILED
    assert c.error is not None and c.error.code == "failure_budget"
    assert "2 failures exceed elastic.max_failures = 1" in c.error.message


def test_node_loss_with_spare_replaces_same_mesh() -> None:
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=5, spares=1)
    c, g = controller(raw)
    start_running(c)
    g.finish_steps(1, 25)
    g.lose_node("node-1")
    assert c.step(130.0) is RunState.LAUNCHING, "a dead node needs no grace period"
    assert c.events.of_kind("decision")[0].detail["action"] == "replace"
    c.step(131.0)
    attempt = g.started[-1]
    assert attempt.attempt == 1 and attempt.config.mesh == g.started[0].config.mesh
    assert "node-1" not in attempt.placement.node_of_rank and "node-4" in attempt.placement.node_of_rank
    g.finish_steps(21, 22)
    c.step(140.0)
    assert c.events.of_kind("first_step_after_recovery")[0].detail["step"] == 21
    assert [h["step"] for h in c.progress.history][-3:] == [20, 21, 22], "steps redone after the commit"


def test_node_loss_without_spare_shrinks_dp_and_keeps_batch() -> None:
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=4, spares=0)
    c, g = controller(raw)
    start_running(c)
    g.lose_node("node-2")
    c.step(130.0)
    c.step(131.0)
    attempt = g.started[-1]
    assert (attempt.config.mesh.dp, attempt.config.mesh.pp, attempt.config.mesh.tp) == (1, 2, 2)
    first = g.started[0].config
    assert attempt.config.train.global_batch == first.train.global_batch == BASE["train"]["global_batch"]
    assert attempt.config.num_microbatches() == 2 * first.num_microbatches(), \
        "half the data-parallel ranks, twice the micro-batches each"
    assert "node-2" not in attempt.placement.node_of_rank
    assert c.events.of_kind("quarantined")[0].detail["node"] == "node-2"


def test_drill_from_the_spec_is_injected_and_reported() -> None:
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=5, spares=1)
    raw["drills"] = [{"kind": "kill-node", "at_step": 5}]
    spec = parse_spec(raw)
    g = FakeWorkerGroup()
    injector = FakeInjector(g)
    c = RunController(spec, spec.topology(), g, now=100.0, injector=injector)
    start_running(c)
    g.finish_steps(1, 4)
    c.step(110.0)
    assert injector.injected == []
    g.finish_steps(5, 6)
    c.step(111.0)
    assert injector.injected == [("kill-node", g.started[0].placement.node_of_rank[-1])]
    c.step(112.5)  # the fake loses the node at once
    c.step(113.0)
    g.finish_steps(1, 1)
    c.step(120.0)
    (report,) = c.to_dict(120.0)["drills"]
    assert report["kind"] == "kill-node" and report["decision"] == "replace" and report["outcome"] == "recovered"
    assert report["detection_s"] == 1.5 and report["recovery_s"] == 9.0 and report["steps_lost"] == 6


def test_a_drill_recovers_when_the_ranks_finish_the_first_step_not_when_it_is_heard() -> None:
    """A step's report may reach the controller well after the ranks finished it (a peer snapshot's
    report waits for the buddies' copies): failure -> first step ends at the step's end."""
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=5, spares=1)
    raw["drills"] = [{"kind": "kill-node", "at_step": 5}]
    spec = parse_spec(raw)
    g = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), g, now=100.0, injector=FakeInjector(g))
    start_running(c)
    g.finish_steps(1, 6)
    c.step(111.0)
    c.step(112.5)
    c.step(113.0)
    g.finish_steps(1, 1, end=117.25)  # finished on the ranks at 117.25, heard of at 120
    c.step(120.0)
    (report,) = c.to_dict(120.0)["drills"]
    assert report["outcome"] == "recovered"
    assert report["recovered_at"] == 117.25 and report["recovery_heard_at"] == 120.0
    assert report["recovery_s"] == 117.25 - 111.0
    (event,) = c.events.of_kind("first_step_after_recovery")
    assert event.detail["ended_at"] == 117.25


@pytest.mark.parametrize("at_state", [RunState.PLANNING, RunState.LAUNCHING, RunState.RUNNING])
def test_cancel_from_any_live_state(at_state: RunState) -> None:
    c, g = controller()
    drive(c, at_state, lambda t: c.step(101.0))
    c.cancel()
    assert c.step(102.0) is RunState.CANCELLED
    assert g.shutdowns == 1
    assert c.events.kinds()[-1] == "cancelled"


def test_infeasible_plan_fails_before_launch() -> None:
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=4, spares=2)
    c, g = controller(raw)
    c.step(101.0)
    assert c.step(102.0) is RunState.FAILED
    assert c.error is not None and c.error.code == "plan_infeasible"
    assert "dp*pp*tp = 2*2*2 = 8 GPUs but the healthy nodes offer 4" in c.error.message
    assert g.started == []


def test_launch_failure_fails_and_cleans_up() -> None:
    c, g = controller(group=FakeWorkerGroup(fail_start=TimeoutError("placement group not ready in 60 s")))
    for t in (1, 2, 3):
        c.step(100.0 + t)
    assert c.state is RunState.FAILED
    assert c.error is not None and "placement group not ready in 60 s" in c.error.message
    assert g.shutdowns == 1


def test_rank_events_join_the_timeline() -> None:
    c, g = controller()
    for t in (1, 2, 3):
        c.step(100.0 + t)
    g.finish_steps(1, 20)
    g.emit(0, "checkpoint_committed", step=20, seconds=1.5)
    c.step(110.0)
    ev = c.events.of_kind("checkpoint_committed")
    assert len(ev) == 1 and ev[0].detail["step"] == 20 and ev[0].attempt == 0
    goodput = c.goodput(110.0)
    assert goodput["wall_seconds"] == 10.0
    assert goodput["productive_seconds"] + sum(goodput["badput_seconds"].values()) == pytest.approx(10.0, abs=1e-3)


def test_relaunch_that_cannot_place_finds_the_silent_dead_node() -> None:
    """A rank died and Ray has not yet declared its node dead: the restart cannot be placed; the
    controller then sees the node missing from the cluster and replaces it instead of failing."""
    raw = copy.deepcopy(BASE)
    spec = parse_spec(raw)
    live = {"topology": spec.topology()}
    g = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), g, now=100.0, topology_source=lambda within_s=None: live["topology"])
    start_running(c)
    g.kill_rank(7)
    c.step(110.0)
    c.step(140.0)
    assert c.state is RunState.LAUNCHING and c.events.of_kind("decision")[0].detail["action"] == "restart"
    lost = g.started[0].placement.node_of_rank[7]
    live["topology"] = Topology(tuple(n for n in spec.topology().nodes if n.name != lost))
    g.fail_next_start(TimeoutError("placement group not ready"))
    c.step(141.0)
    assert c.state is RunState.LAUNCHING
    detected = c.events.of_kind("failure_detected")[-1].detail
    assert detected["cause"] == "node_lost" and detected["nodes"] == [lost]
    assert c.events.of_kind("decision")[-1].detail["action"] == "replace"
    c.step(142.0)
    assert c.state is RunState.RUNNING and lost not in g.started[-1].placement.node_of_rank


def test_below_min_dp_waits_for_capacity_then_launches_or_fails() -> None:
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=4, spares=0)
    raw["elastic"].update(min_dp=2, wait_for_capacity_s=60)
    spec = parse_spec(raw)
    full = spec.topology()
    live = {"topology": Topology(tuple(n for n in full.nodes if n.name != "node-2"))}
    for node_returns, expected in ((True, RunState.LAUNCHING), (False, RunState.FAILED)):
        live["topology"] = Topology(tuple(n for n in full.nodes if n.name != "node-2"))
        g = FakeWorkerGroup()
        c = RunController(spec, full, g, now=100.0, topology_source=lambda within_s=None: live["topology"])
        start_running(c)
        g.lose_node("node-2")
        assert c.step(110.0) is RunState.RECOVERING
        assert c.events.of_kind("decision")[0].detail["action"] == "wait"
        assert c.step(130.0) is RunState.RECOVERING, "still no capacity"
        if node_returns:
            live["topology"] = full
        c.step(171.0)
        assert c.state is expected
        if expected is RunState.LAUNCHING:
            decision = c.events.of_kind("decision")[-1].detail
            assert decision["action"] == "grow" and decision["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
        else:
            assert c.error is not None and c.error.code == "no_capacity" and "after 60 s" in c.error.message


def test_auto_checkpointing_starts_the_next_attempt_at_the_interval_the_last_one_chose() -> None:
    raw = copy.deepcopy(BASE)
    raw["checkpoint"] = {**raw["checkpoint"], "every_steps": "auto"}
    c, g = controller(raw)
    start_running(c)
    assert (g.started[-1].checkpoint_auto, g.started[-1].checkpoint_every) == (True, 0), "first: step 10, then measure"
    g.finish_steps(1, 10)
    g.emit(0, "checkpoint_interval", steps=37, save_cost_s=0.2, mtbf_s=86400.0, step_time_s=0.5, rule="young_daly")
    c.step(110.0)
    g.error_worker(3, "ValueError: boom")
    c.step(111.0)
    c.step(111.0 + ATTRIBUTION_GRACE_S)
    c.step(120.0)
    assert g.started[-1].attempt == 1 and g.started[-1].checkpoint_auto
    assert g.started[-1].checkpoint_every == 37, "not step 10 again: the save cost is measured at the first save"


def test_a_commit_that_grows_the_run_drops_no_event_of_its_poll() -> None:
    """A shrunk run's node comes back; the poll that brings the commit (where it grows back) also
    brings events after it: every one joins the timeline (the loop used to return at the commit)."""
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=4, spares=0)
    spec = parse_spec(raw)
    full = spec.topology()
    live = {"topology": Topology(tuple(n for n in full.nodes if n.name != "node-2"))}
    g = FakeWorkerGroup()
    c = RunController(spec, full, g, now=100.0, topology_source=lambda within_s=None: live["topology"])
    start_running(c)
    g.lose_node("node-2")
    c.step(110.0)
    start_running(c)
    assert c.config is not None and c.config.mesh.dp == 1
    live["topology"] = full
    g.finish_steps(1, 20)
    g.emit(0, "checkpoint_committed", step=20, seconds=0.1)
    g.emit(0, "checkpoint_interval", steps=25)
    g.emit(3, "loss_anomaly", step=20, loss=9.0)
    c.step(150.0)
    kinds = c.events.kinds()
    assert kinds.index("checkpoint_committed") < kinds.index("checkpoint_interval") < kinds.index("loss_anomaly")
    assert c.events.of_kind("decision")[-1].detail["code"] == "grown"
    assert c.state is RunState.LAUNCHING


def test_a_cluster_that_does_not_answer_by_the_way_leaves_the_run_training_until_it_does() -> None:
    """A shrunk run asks the cluster at a commit whether its node is back, and waits a poll's time at
    most (a controller cut off from the cluster must go on polling): no answer, no growth and no
    failure; the next commit after the cluster answers grows the run back."""
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=4, spares=0)
    spec = parse_spec(raw)
    full = spec.topology()
    live = {"topology": Topology(tuple(n for n in full.nodes if n.name != "node-2")), "silent": False}
    waits: list[float | None] = []

    def source(within_s: float | None = None) -> Topology:
        waits.append(within_s)
        if live["silent"] and within_s is not None:
            raise ClusterSilent(f"no answer within {within_s} s")
        return live["topology"]  # type: ignore[return-value]

    g = FakeWorkerGroup()
    c = RunController(spec, full, g, now=100.0, topology_source=source)
    start_running(c)
    g.lose_node("node-2")
    c.step(110.0)
    start_running(c)
    assert c.config is not None and c.config.mesh.dp == 1
    live.update(topology=full, silent=True)
    waits.clear()
    g.finish_steps(1, 20)
    g.emit(0, "checkpoint_committed", step=20, seconds=0.1)
    assert c.step(150.0) is RunState.RUNNING and c.config.mesh.dp == 1, "not grown, not failed"
    assert waits and all(w is not None for w in waits), "every read while it trains is bounded"
    live["silent"] = False
    g.finish_steps(21, 40)
    g.emit(0, "checkpoint_committed", step=40, seconds=0.1)
    assert c.step(160.0) is RunState.LAUNCHING
    assert c.events.of_kind("decision")[-1].detail["code"] == "grown"


def test_a_drill_being_injected_is_found_pending() -> None:
    """Injection runs outside the run's lock: a request for the drill's report meanwhile (it has left
    the schedule and is not in the timeline yet) gets `pending`, not 404."""
    c, g = controller()
    start_running(c)
    seen: list[dict | None] = []

    class Asking(FakeInjector):
        def inject(self, kind: str, target: str, **kw: object) -> dict:
            seen.append(c.drill(request.id))
            return super().inject(kind, target, **kw)  # type: ignore[arg-type]

    c.injector = Asking(g)
    request = c.request_drill(120.0, "kill-rank", target="3")
    g.finish_steps(1, 1)
    c.step(121.0)
    assert seen and seen[0] is not None and seen[0]["outcome"] == "pending", seen
    assert c.drill(request.id)["outcome"] == "pending"  # type: ignore[index]
    assert c.events.count("drill_injected") == 1


def test_cancel_while_recovering() -> None:
    """The state the parametrized cancel test cannot reach by stepping: waiting for capacity."""
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"].update(nodes=4, spares=0)
    raw["elastic"].update(min_dp=2, wait_for_capacity_s=600)
    spec = parse_spec(raw)
    full = spec.topology()
    g = FakeWorkerGroup()
    c = RunController(spec, full, g, now=100.0,
                      topology_source=lambda within_s=None: Topology(tuple(n for n in full.nodes if n.name != "node-2")))
    start_running(c)
    g.lose_node("node-2")
    assert c.step(110.0) is RunState.RECOVERING
    shutdowns = g.shutdowns
    c.cancel()
    assert c.step(111.0) is RunState.CANCELLED
    assert g.shutdowns == shutdowns + 1 and c.events.kinds()[-1] == "cancelled"


def test_a_repaired_node_stands_in_at_the_next_loss_when_the_spares_are_used() -> None:
    """Full mesh, one spare: node A is lost (the spare takes over) and comes back repaired; node B is
    then lost. The run never shrank, so nothing grew it back, but the returned node is healthy and
    idle: it takes B's place, the mesh unchanged (it used to wait for capacity, or shrink)."""
    raw = copy.deepcopy(BASE)
    raw["drills"] = []
    spec = parse_spec(raw)
    full = spec.topology()
    live = {"topology": full}
    g = FakeWorkerGroup()
    c = RunController(spec, full, g, now=100.0, topology_source=lambda within_s=None: live["topology"])
    start_running(c)
    first = g.started[0].placement.node_of_rank[7]
    live["topology"] = Topology(tuple(n for n in full.nodes if n.name != first))
    g.lose_node(first)
    c.step(110.0)
    c.step(111.0)
    assert c.events.of_kind("decision")[-1].detail["action"] == "replace" and c.state is RunState.RUNNING
    second = g.started[-1].placement.node_of_rank[0]  # the first lost node is back, repaired; this one is lost
    live["topology"] = Topology(tuple(n for n in full.nodes if n.name != second))
    g.lose_node(second)
    c.step(120.0)
    c.step(121.0)
    decision = c.events.of_kind("decision")[-1].detail
    assert decision["action"] == "replace" and decision["mesh"] == {"dp": 2, "pp": 2, "tp": 2}, decision
    assert c.state is RunState.RUNNING and first in g.started[-1].placement.node_of_rank


def test_a_replica_failure_domain_is_refused_where_the_worker_group_cannot_keep_the_others_training() -> None:
    raw = copy.deepcopy(BASE)
    raw["elastic"] = {**(raw.get("elastic") or {}), "failure_domain": "replica"}
    c, g = controller(raw)
    c.step(101.0)
    assert c.step(102.0) is RunState.FAILED and not g.started
    assert c.error is not None and c.error.code == "unsupported"
    assert "failure_domain: world" in c.error.message and "FakeWorkerGroup" in c.error.message


class WarmingGroup(FakeWorkerGroup):
    """A worker group that keeps warm workers (controller/ray/worker_group.py's `prewarm`)."""

    def __init__(self) -> None:
        super().__init__()
        self.prewarmed: list[tuple[float, list[str]]] = []
        self.now = 0.0

    def prewarm(self, nodes: list[str]) -> None:
        self.prewarmed.append((self.now, nodes))


def test_a_spare_that_came_after_the_launch_gets_warm_workers_before_a_recovery_needs_them() -> None:
    """A node back from repair refills the spare pool after the launch: the running attempt's
    worker group is asked to warm it (every WARM_SPARES_EVERY_S at most), not the next recovery. Only
    once the attempt has finished a step (the first launch leaves its spares to this, off the
    startup's path)."""
    from controller.state import WARM_SPARES_EVERY_S
    from controller.topology import NodeState

    spec = parse_spec(BASE)
    full = spec.topology()
    (spare,) = [n.name for n in full.spares()]
    live = {"topology": full}
    g = WarmingGroup()
    c = RunController(spec, full, g, now=100.0, topology_source=lambda within_s=None: live["topology"])
    start_running(c)
    t = 110.0
    for _ in range(8):
        g.now = t
        c.step(t)
        t += 1.0
    assert g.prewarmed == [], "nothing warmed before the attempt's first step"
    g.finish_steps(1, 1)
    for _ in range(20):
        g.now = t
        c.step(t)
        t += 1.0
    times = [at for at, _ in g.prewarmed]
    assert times and all(b - a >= WARM_SPARES_EVERY_S for a, b in zip(times, times[1:]))
    assert all(nodes == [spare] for _, nodes in g.prewarmed)
    back = full.nodes[0].name  # (a training node lost earlier, back as a spare)
    live["topology"] = full.with_states({back: NodeState.SPARE})
    for _ in range(6):
        g.now = t
        c.step(t)
        t += 1.0
    assert sorted(g.prewarmed[-1][1]) == sorted([spare, back])
    assert c.state is RunState.RUNNING
