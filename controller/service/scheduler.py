"""Admission: which queued run starts now. Runs are admitted in submission order (first come, first
served), each when its plan fits the nodes no other run holds; a run that does not fit blocks the ones
behind it (no overtaking: a big run is never starved by small ones), and a run the whole cluster can no
longer hold (nodes quarantined or lost since it was queued) is refused. Pure: the service's scheduler
thread applies the verdicts."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controller.placement import Placement
from controller.planner import MeshPlan, plan_run
from controller.spec import RunSpec, SpecError
from controller.topology import NodeState, Topology

BEHIND_EARLIER = "runs submitted earlier wait for capacity first"


class Verdict(enum.Enum):
    ADMIT = "admit"
    WAIT = "wait"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    reason: str = ""
    """Why it waits or is refused."""
    plan: tuple[MeshPlan, Placement] | None = None
    """ADMIT: the plan made on the free nodes (the run launches with it: no second planning pass)."""


def admission(spec: RunSpec, free: Topology, total: Topology, *, recovering: bool = False) -> Admission:
    """The verdict on the first queued run and why: `free` are the nodes no run holds, `total` every
    node the service may use. Every run queued behind one that waits waits too (BEHIND_EARLIER).
    `recovering`: the run trained before (a resume after its workers were lost, e.g. with a restarted
    service): hot spares are there to take lost nodes' places, so free spares count when the healthy
    nodes alone cannot hold it, as few as make it fit."""
    try:
        return Admission(Verdict.ADMIT, plan=plan_run(spec, free))
    except SpecError as e:
        if recovering and (plan := _with_spares(spec, free)) is not None:
            return Admission(Verdict.ADMIT, plan=plan)
        try:
            plan_run(spec, total)
        except SpecError as never:
            if not (recovering and _with_spares(spec, total) is not None):
                return Admission(Verdict.REFUSE, f"the service's cluster can no longer hold the run: {never}")
        return Admission(Verdict.WAIT, f"waiting for capacity: {free_gpus(free)} free GPU(s) now; {e}")


def _with_spares(spec: RunSpec, topology: Topology) -> tuple[MeshPlan, Placement] | None:
    """The plan on `topology` with its first k spares taken as healthy nodes, for the smallest k
    that fits (None: not even with all of them)."""
    spares = [n.name for n in topology.spares()]
    for k in range(1, len(spares) + 1):
        try:
            return plan_run(spec, topology.with_states({name: NodeState.HEALTHY for name in spares[:k]}))
        except SpecError:
            continue
    return None


def free_gpus(topology: Topology) -> int:
    return sum(n.num_gpus for n in topology.nodes if n.state is NodeState.HEALTHY)
