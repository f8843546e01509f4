"""Admission: which queued run starts now. The queue is ordered by priority class (higher first), then
by its team's fair share (the team using the smaller part of its GPU quota first), then by submission;
each run is admitted when its plan fits the nodes no other run holds and its team's quota has room.
A run that waits for capacity holds back every run ordered after it (no overtaking: the nodes freed go
to it first, so small runs arriving later never starve a big one, and the fair share only orders
teams by the part of their quota in use, so a team running nothing is first within its class). A run
waiting for its own team's quota holds back no other team. A run the whole cluster can no longer hold
(nodes quarantined or lost since it was queued) is refused. Pure: the service's scheduler thread
applies the verdicts."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from controller.placement import Placement
from controller.planner import MeshPlan, plan_run
from controller.spec import RunSpec, SpecError
from controller.topology import NodeState, Topology

BEHIND_EARLIER = ("runs queued ahead of it (earlier, or of a higher priority, or of a team using less of its "
                  "quota) wait for capacity first")


@dataclass(frozen=True)
class Queued:
    """A run as the queue orders it."""
    seq: int
    team: str
    priority: int
    gpus: int


def queue_order(queued: list[Queued], usage: dict[str, int], quotas: dict[str, int | None], total_gpus: int
                ) -> list[Queued]:
    """Priority (higher first), then the team's share of its quota in use now (a team without a quota:
    of the whole cluster), then submission."""
    def share(team: str) -> float:
        quota = quotas.get(team)
        return usage.get(team, 0) / (quota if quota else max(total_gpus, 1))
    return sorted(queued, key=lambda q: (-q.priority, share(q.team), q.seq))


@dataclass(frozen=True)
class Running:
    """An admitted run as a preemption sees it."""
    seq: int
    priority: int
    gpus: int
    nodes: frozenset[str]
    """The nodes it holds (freed when it stops)."""


MAX_VICTIM_CANDIDATES = 12
"""Lower-priority runs looked at for a preemption (their subsets are tried: 4,096 at most)."""


def preemption_victims(spec: RunSpec, priority: int, free: Topology, usable: Topology,
                       running: list[Running]) -> tuple[int, ...] | None:
    """The lower-priority runs to stop so that `spec` fits on the free nodes and theirs: the fewest GPUs
    that make it fit, then the lowest priorities, then the newest runs; None when stopping every one of
    them would not make it fit."""
    candidates = sorted((r for r in running if r.priority < priority), key=lambda r: (r.priority, -r.seq))
    candidates = candidates[:MAX_VICTIM_CANDIDATES]
    subsets = [c for n in range(1, len(candidates) + 1) for c in itertools.combinations(candidates, n)]
    subsets.sort(key=lambda c: (sum(r.gpus for r in c), sorted(r.priority for r in c), sorted(-r.seq for r in c)))
    free_names = {n.name for n in free.nodes}
    for subset in subsets:
        names = free_names.union(*(r.nodes for r in subset))
        try:
            plan_run(spec, Topology(tuple(n for n in usable.nodes if n.name in names)))
        except SpecError:
            continue
        return tuple(sorted(r.seq for r in subset))
    return None


def quota_problem(run: Queued, usage: dict[str, int], quotas: dict[str, int | None]) -> str | None:
    """Why the run's team cannot take its GPUs now (None: it can)."""
    quota = quotas.get(run.team)
    held = usage.get(run.team, 0)
    if quota is None or held + run.gpus <= quota:
        return None
    return (f"waiting for team {run.team}'s quota: its runs hold {held} of its {quota} GPU(s) and this one needs "
            f"{run.gpus}")


def requested_gpus(spec: RunSpec, total: Topology) -> int:
    """The GPUs a run asks for: its mesh's ranks (planned on every usable node when parallelism is auto)."""
    if spec.parallelism != "auto":
        p = spec.parallelism
        return p.dp * p.pp * p.tp
    try:
        return plan_run(spec, total)[0].mesh.world_size
    except SpecError:
        return 0


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
