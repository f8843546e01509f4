"""Silence verdicts (health/heartbeat.py) and what follows from them in the pure core: who is silent,
when the controller suspects itself, what corroborates a loss, a node lost silently not taken back
while Ray lists it under the same id, and the silent-fault drills' parameters."""

from __future__ import annotations

import pytest

from controller.drills import DrillKind, params_problem
from controller.topology import Node, NodeState, Topology, merge_returned
from health.heartbeat import HEARTBEAT_TIMEOUT_S, corroborated, silence


def test_a_node_whose_heartbeat_stopped_is_silent_and_the_others_are_not() -> None:
    v = silence(100.0, {"a": 99.9, "b": 100.0 - HEARTBEAT_TIMEOUT_S - 0.1, "c": 99.5})
    assert v.silent == ("b",) and not v.self_suspect and v.silent_s["b"] == pytest.approx(HEARTBEAT_TIMEOUT_S + 0.1)


def test_a_late_beat_within_the_timeout_is_not_silence() -> None:
    """A 50 ms link delays each beat by 50 ms: far inside the timeout."""
    assert silence(100.0, {"a": 100.0 - HEARTBEAT_TIMEOUT_S + 0.05, "b": 99.95}).silent == ()


def test_every_node_silent_at_once_the_controller_suspects_itself_and_loses_nobody() -> None:
    v = silence(100.0, {"a": 90.0, "b": 91.0, "c": 92.0})
    assert v.self_suspect and v.silent == ()
    one = silence(100.0, {"a": 90.0})  # (one node alone cannot tell the two apart: corroboration decides)
    assert not one.self_suspect and one.silent == ("a",)


def test_silence_is_lost_only_when_other_evidence_agrees() -> None:
    silent = ("a", "b", "c")
    assert corroborated(silent, probe_unanswered={"a"}, drains_unanswered={"b"}, collectives_failed=set()) == {"a", "b"}
    assert corroborated(silent, probe_unanswered=set(), drains_unanswered=set(), collectives_failed=set()) == set()


def node(name: str, state: NodeState, ray_id: str | None) -> Node:
    return Node(name=name, rack="r0", num_gpus=2, gpu_memory_bytes=1, state=state, ray_node_id=ray_id)


def test_a_node_lost_silently_is_not_taken_back_while_ray_lists_it_under_the_same_id() -> None:
    ours = Topology((node("a", NodeState.HEALTHY, "id-a"), node("b", NodeState.LOST, "id-b")))
    same = Topology((node("a", NodeState.HEALTHY, "id-a"), node("b", NodeState.HEALTHY, "id-b")))
    assert merge_returned(ours, same).node("b").state is NodeState.LOST
    repaired = Topology((node("a", NodeState.HEALTHY, "id-a"), node("b", NodeState.HEALTHY, "id-b2")))
    back = merge_returned(ours, repaired).node("b")
    assert back.state is NodeState.HEALTHY and back.ray_node_id == "id-b2", "back under a new id, which it keeps"
    lost_again = merge_returned(ours, repaired).with_states({"b": NodeState.LOST})
    assert merge_returned(lost_again, repaired).node("b").state is NodeState.LOST, "lost again under the id it came back with"


@pytest.mark.parametrize(("kind", "params", "problem"), [
    ("power-off", {}, None),
    ("partition", {"seconds": 10.0}, None),
    ("freeze-node", {"seconds": 5.0}, None),
    ("slow-link", {"delay_ms": 50.0}, None),
    ("lossy-link", {"loss": 5.0}, None),
    ("power-off", {"seconds": 3.0}, "seconds is for storage-outage, partition, freeze-node, collective-fault, spot-reclaim drills, not power-off"),
    ("slow-link", {"loss": 3.0}, "loss is for lossy-link drills, not slow-link"),
    ("lossy-link", {"loss": 130.0}, "loss = 130.0 must be in (0, 100]"),
    ("slow-link", {"delay_ms": -1.0}, "delay_ms = -1.0 must be in (0, 60000]"),
])
def test_silent_fault_drills_take_their_own_parameter(kind: str, params: dict, problem: str | None) -> None:
    found = params_problem(DrillKind(kind), **params)
    assert (found is None) if problem is None else (found is not None and problem in found), found
    assert DrillKind(kind).silent and DrillKind(kind).target == "node"
