"""The collective-fault drill: an operator fails (or delays) one named collective of the replica
protocol on one rank, as the dist tests' fault injector does (trainer/protocol.ProtocolFault). Its
parameters, the runs that can take it, the switch that carries it to the training process, and the
trainer arming it for the next time the rank reaches that point. On a Ray cluster:
tests/cluster/test_replica_domain.py; in the simulator: tests/unit/test_sim_replica.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from controller.cli.main import build_parser
from controller.drills import DrillError, DrillKind, domain_problem, params_problem
from controller.run_state import RunState
from controller.spec import SpecError, parse_spec
from controller.state import RunController
from tests.unit.fakes import FakeInjector, FakeReplicaGroup, drive
from trainer.protocol import PROTOCOL_POINTS, ProtocolFault
from trainer.replica import CrossReplica
from trainer.switches import DrillSwitches
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("params", "problem"), [
    ({}, None),
    ({"point": "sync"}, None),
    ({"point": "init", "seconds": 30.0}, None),
    ({"point": "gather"}, "point = 'gather' is not a point of the replica protocol; give one of init, reduce"),
    ({"seconds": -2.0}, "seconds = -2.0 must be > 0"),
    ({"factor": 2.0}, "factor is for slow-rank drills, not collective-fault"),
])
def test_a_collective_fault_takes_a_point_and_a_delay(params: dict, problem: str | None) -> None:
    found = params_problem(DrillKind.COLLECTIVE_FAULT, **params)
    assert (found is None) if problem is None else (found is not None and problem in found), found
    assert params_problem(DrillKind.SLOW_RANK, point="reduce") == "point is for collective-fault drills, not slow-rank"


def test_only_a_run_of_replicas_can_take_it() -> None:
    assert domain_problem(DrillKind.COLLECTIVE_FAULT, "replica", 2) is None
    assert "needs elastic.failure_domain: replica" in (domain_problem(DrillKind.COLLECTIVE_FAULT, "world", 2) or "")
    assert "dp_replicas >= 2" in (domain_problem(DrillKind.COLLECTIVE_FAULT, "replica", 1) or "")
    assert domain_problem(DrillKind.KILL_NODE, "world", 1) is None
    world = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    world["drills"] = [{"kind": "collective-fault", "at_step": 3}]
    with pytest.raises(SpecError, match="collective-fault fails a collective between data-parallel replicas"):
        parse_spec(world)


def test_a_replica_run_queues_and_injects_it_with_its_point() -> None:
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt-replicas.yaml").read_text())
    raw["drills"] = []
    spec = parse_spec(raw)
    group = FakeReplicaGroup()
    injector = FakeInjector(group)
    c = RunController(spec, spec.topology(), group, now=100.0, injector=injector, topology_source=spec.topology)
    t = drive(c, RunState.RUNNING)
    request = c.request_drill(t, "collective-fault", target="replica:0", point="agree", seconds=25.0)
    assert request.to_dict()["point"] == "agree" and request.to_dict()["seconds"] == 25.0
    assert c.request_drill(t, "collective-fault").to_dict()["point"] == "reduce", "the gradient reduce by default"
    with pytest.raises(DrillError, match="not a point of the replica protocol"):
        c.request_drill(t, "collective-fault", point="gather")
    group.finish_steps(1, 2)
    c.step(t)
    assert injector.injected[:2] == [("collective-fault", "3"), ("collective-fault", "7")]
    assert injector.params[0]["point"] == "agree" and injector.params[0]["seconds"] == 25.0


def test_the_switch_arms_the_rank_once_for_the_next_time_it_reaches_the_point() -> None:
    """The slot's switch carries the request into the training process; the trainer arms a fault
    with no step (the next time the point comes), once per request, and not one an earlier process
    on the slot was asked for."""
    switches = DrillSwitches()
    switches.request_collective_fault(PROTOCOL_POINTS.index("reduce"), None)  # before this process
    cross = SimpleNamespace(faults=[])
    trainer = SimpleNamespace(switches=switches, replicas=cross, rank=5, faults_armed=switches.collective_faults)
    Trainer._arm_collective_faults(trainer)  # type: ignore[arg-type]
    assert cross.faults == []
    switches.request_collective_fault(PROTOCOL_POINTS.index("sync"), 30.0)
    Trainer._arm_collective_faults(trainer)  # type: ignore[arg-type]
    Trainer._arm_collective_faults(trainer)  # type: ignore[arg-type]
    assert cross.faults == [ProtocolFault("sync", 5, None, 30.0)]
    # CrossReplica fires it at whatever step the rank reaches the point, once.
    replica = SimpleNamespace(faults=[ProtocolFault("reduce", 5, None)], at_step=41)
    CrossReplica.inject(replica, "vote")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="injected protocol fault: reduce failed at step 41"):
        CrossReplica.inject(replica, "reduce")  # type: ignore[arg-type]
    CrossReplica.inject(replica, "reduce")  # type: ignore[arg-type]
    assert replica.faults == []


def test_the_cli_takes_the_point() -> None:
    opts = build_parser().parse_args(["drill", "r1", "collective-fault", "--point", "vote", "--seconds", "40"])
    assert (opts.kind, opts.point, opts.seconds) == ("collective-fault", "vote", 40.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["drill", "r1", "collective-fault", "--point", "gather"])


def test_a_drill_of_the_spec_keeps_its_point() -> None:
    """(A spec's drill lost its point on the way to the schedule: the run failed `reduce` instead of
    `sync`, found by tests/cluster/test_replica_domain.py.)"""
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt-replicas.yaml").read_text())
    raw["drills"] = [{"kind": "collective-fault", "at_step": 4, "target": "replica:0", "point": "sync", "seconds": 12}]
    spec = parse_spec(raw)
    c = RunController(spec, spec.topology(), FakeReplicaGroup(), now=100.0, topology_source=spec.topology)
    (pending,) = c.drills.pending()
    assert pending.to_dict()["point"] == "sync" and pending.params()["seconds"] == 12


class ArmingInjector(FakeInjector):
    """An injector that, as the Ray one, hands collective faults over ahead of their step."""

    arms_ahead = frozenset({DrillKind.COLLECTIVE_FAULT})


def test_a_fault_with_a_step_is_handed_over_ahead_and_acts_from_the_step_after_it() -> None:
    """(The controller hears of a step a poll after it ends, and a step of a small model is shorter
    than that: a fault injected when step 5 was heard of failed step 7 or 8, not step 6.) The Ray
    injector takes a collective fault as soon as the attempt has stepped, with the step it acts
    from; the other drills wait for theirs; the event says the drill's own step and when it was
    handed over."""
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt-replicas.yaml").read_text())
    raw["drills"] = [{"kind": "kill-node", "at_step": 3, "target": "replica:0"},
                     {"kind": "collective-fault", "at_step": 5, "target": "replica:1"}]
    spec = parse_spec(raw)
    group = FakeReplicaGroup()
    injector = ArmingInjector(group)
    c = RunController(spec, spec.topology(), group, now=100.0, topology_source=spec.topology, injector=injector)
    t = drive(c, RunState.RUNNING)
    group.finish_steps(1, 1)
    c.step(t)
    assert injector.injected == [("collective-fault", "7")], "the kill waits for step 3; the fault is handed over"
    assert injector.params[0]["from_step"] == 6 and injector.params[0]["point"] is None
    (ev,) = c.events.of_kind("drill_injected")
    assert (ev.detail["step"], ev.detail["from_step"], ev.detail["armed_at_step"]) == (5, 6, 1), ev.detail
    # A drill whose step had passed when it came due acts at the next point, as before.
    late = c.request_drill(t, "collective-fault", target="replica:1")
    c.step(t)
    assert injector.params[-1].get("from_step") is None and len(injector.injected) == 2, late
    # The simulator's injector (no arms_ahead) gets every drill at its step, as before.
    plain = FakeInjector(group)
    d = RunController(spec, spec.topology(), FakeReplicaGroup(), now=100.0, topology_source=spec.topology,
                      injector=plain)
    assert d.drills.schedule.pop_due(1) is None, "neither drill's step has come"
    due = [d.drills.schedule.pop_due(5) for _ in range(2)]
    assert [r.kind for r in due if r is not None] == ["kill-node", "collective-fault"], "both, in step order"


def test_the_slot_holds_a_fault_until_its_step_even_for_the_next_process() -> None:
    """The switch carries the step it acts from: the trainer arms it once its step has come, a
    training process that starts on the slot before then (a new attempt) arms it too, and one that
    starts after it was armed does not."""
    switches = DrillSwitches()
    switches.request_collective_fault(PROTOCOL_POINTS.index("reduce"), None, from_step=6)
    assert switches.collective_fault == (PROTOCOL_POINTS.index("reduce"), None, 6) and switches.holds_collective_fault
    cross = SimpleNamespace(faults=[], at_step=4)
    fresh = switches.collective_faults - switches.holds_collective_fault  # (Trainer.__init__)
    trainer = SimpleNamespace(switches=switches, replicas=cross, rank=7, faults_armed=fresh)
    Trainer._arm_collective_faults(trainer)  # type: ignore[arg-type]
    assert cross.faults == [], "step 4: held"
    cross.at_step = 6
    Trainer._arm_collective_faults(trainer)  # type: ignore[arg-type]
    assert cross.faults == [ProtocolFault("reduce", 7, None, None)]
    assert not switches.holds_collective_fault
    assert switches.collective_faults - switches.holds_collective_fault == switches.collective_faults, \
        "a process after the one that armed it does not arm it again"
    with pytest.raises(ValueError, match="from a step >= 1"):
        switches.request_collective_fault(0, None, from_step=0)


def test_a_fault_handed_over_ahead_is_timed_from_the_step_it_failed() -> None:
    """Its report's origin is the discard of its step by the first rank's clock, not the hand-over
    (seconds earlier): the detection is the controller hearing of it."""
    from controller.drill_reports import drill_report
    from controller.events import Event, EventKind

    armed = {"id": "drill-1", "drill": DrillKind.COLLECTIVE_FAULT, "target": "7", "step": 5, "from_step": 6,
             "armed_at_step": 1, "point": "reduce"}
    events = [Event(100.0, "r", 0, EventKind.DRILL_INJECTED, armed),
              Event(103.5, "r", 0, EventKind.REPLICA_STEP_DISCARDED, {"step": 6, "epoch": 0, "time": 103.2, "rank": 4}),
              Event(103.5, "r", 0, EventKind.REPLICA_RESYNC, {"epoch": 1, "step": 6}),
              Event(104.0, "r", 0, EventKind.FIRST_STEP_AFTER_RECOVERY, {"step": 6, "ended_at": 103.9})]
    report = drill_report(events, 0)
    assert report["at_step"] == 5 and report["fault_at"] == 103.2 and report["outcome"] == "recovered", report
    assert report["detection_s"] == pytest.approx(0.3) and report["recovery_s"] == pytest.approx(0.7), report
    plain = drill_report([Event(100.0, "r", 0, EventKind.DRILL_INJECTED, {k: v for k, v in armed.items()
                                                                     if k not in ("from_step", "armed_at_step")}),
                          *events[1:]], 0)
    assert "fault_at" not in plain and plain["detection_s"] == pytest.approx(3.5), plain
