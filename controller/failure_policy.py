"""What to do about a failure: a pure function from (now, history, event, cluster) to a Decision.

- a spare node exists      -> replace the lost node with it, same mesh;
- no spare                 -> shrink dp to the largest value the healthy GPUs allow, tp and pp kept
                              (>= elastic.min_dp); the global batch is kept by more micro-batches;
- below min_dp             -> wait for capacity up to a bound, then fail with the reason;
- capacity back (a node joined) and dp < the spec's -> grow back at the next checkpoint;
- more than elastic.max_failures failures -> fail.
A node blamed for silent data corruption or a persistent slowdown is quarantined rather than lost:
the same decisions follow, but it never comes back into the run.
The controller acts on the decision; nothing here touches Ray or torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from controller.placement import PlacementError, place
from controller.topology import NodeState, Topology
from trainer.config import MeshShape


class FailureCause(str, enum.Enum):
    NODE_LOST = "node_lost"
    RANK_DIED = "rank_died"
    HANG = "hang"
    COLLECTIVE_ERROR = "collective_error"
    WORKER_ERROR = "worker_error"
    SDC = "sdc"
    STRAGGLER = "straggler"

    @property
    def quarantines(self) -> bool:
        """The node is alive but not to be trusted: it gets no rank for the rest of the run (a lost
        node may come back; a quarantined one does not)."""
        return self in (FailureCause.SDC, FailureCause.STRAGGLER)


@dataclass(frozen=True, kw_only=True)
class FailureEvent:
    time: float
    """When the controller detected it."""
    cause: FailureCause
    """What failed (the cause, not the survivors' symptoms)."""
    nodes: tuple[str, ...] = ()
    """Nodes to take out of service (lost or holding a hung/dead rank on a lost node)."""
    ranks: tuple[int, ...] = ()
    """Ranks that died or stopped."""
    message: str = ""
    """Human-readable detail."""
    evidence: dict = field(default_factory=dict)
    """What pointed at the ranks (SDC: the probes' findings per rank)."""


class Action(str, enum.Enum):
    REPLACE = "replace"
    SHRINK = "shrink"
    RESTART = "restart"
    WAIT = "wait"
    GROW = "grow"
    FAIL = "fail"


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    """What the controller does next."""
    mesh: MeshShape | None
    """Mesh of the next attempt (None for wait/fail)."""
    topology: Topology
    """The cluster as the next attempt sees it (lost nodes marked, spares promoted)."""
    reason: str
    """Why, with the numbers."""


@dataclass(frozen=True, kw_only=True)
class ElasticLimits:
    min_dp: int
    """Smallest dp a run may shrink to."""
    max_failures: int
    """Failures after which the run fails."""
    wait_for_capacity_s: float = 300.0
    """How long to wait below min_dp before failing."""


def largest_dp(mesh: MeshShape, topology: Topology, global_batch: int, micro_batch: int) -> int:
    """Largest dp <= mesh.dp with the batch divisible and a feasible placement on healthy nodes."""
    for dp in range(mesh.dp, 0, -1):
        if global_batch % (dp * micro_batch):
            continue
        try:
            place(MeshShape(dp=dp, pp=mesh.pp, tp=mesh.tp), topology)
        except PlacementError:
            continue
        return dp
    return 0


def decide(now: float, *, event: FailureEvent, failures_so_far: int, mesh: MeshShape, spec_mesh: MeshShape,
           topology: Topology, limits: ElasticLimits, global_batch: int, micro_batch: int,
           waiting_since: float | None = None) -> Decision:
    """`failures_so_far` counts earlier failures of the run (this one excluded)."""
    failures = failures_so_far + 1
    for node in event.nodes:
        topology = topology.with_state(node, NodeState.QUARANTINED if event.cause.quarantines else NodeState.LOST)
    if failures > limits.max_failures:
        return Decision(action=Action.FAIL, mesh=None, topology=topology,
                        reason=f"{failures} failures exceed elastic.max_failures = {limits.max_failures}")
    if not event.nodes:
        # A rank died or hung on a node that is still alive: the same mesh on the same nodes.
        return Decision(action=Action.RESTART, mesh=mesh, topology=topology,
                        reason=f"{event.cause.value} on ranks {list(event.ranks)}; nodes still healthy")
    spares = topology.spares()
    lost_in_use = list(event.nodes)
    lost = "quarantined" if event.cause.quarantines else "lost"
    if len(spares) >= len(lost_in_use):
        promoted = []
        for spare in spares[: len(lost_in_use)]:
            topology = topology.with_state(spare.name, NodeState.HEALTHY)
            promoted.append(spare.name)
        try:
            place(mesh, topology)
            return Decision(action=Action.REPLACE, mesh=mesh, topology=topology,
                            reason=f"{lost} {lost_in_use}; spare {promoted} takes over, mesh unchanged")
        except PlacementError:
            pass  # spares too small for the mesh: fall through to shrinking
    dp = largest_dp(mesh, topology, global_batch, micro_batch)
    if dp >= limits.min_dp:
        new = MeshShape(dp=dp, pp=mesh.pp, tp=mesh.tp)
        return Decision(action=Action.SHRINK, mesh=new, topology=topology,
                        reason=f"{lost} {lost_in_use}, no spare: dp {mesh.dp} -> {dp} (pp{mesh.pp} tp{mesh.tp} kept, "
                               f"{global_batch // (dp * micro_batch)} micro-batches per step keep global batch "
                               f"{global_batch})")
    started = waiting_since if waiting_since is not None else now
    if now - started < limits.wait_for_capacity_s:
        return Decision(action=Action.WAIT, mesh=None, topology=topology,
                        reason=f"healthy GPUs allow dp {dp} < elastic.min_dp = {limits.min_dp}; waiting up to "
                               f"{limits.wait_for_capacity_s:.0f} s for capacity")
    return Decision(action=Action.FAIL, mesh=None, topology=topology,
                    reason=f"healthy GPUs allow dp {dp} < elastic.min_dp = {limits.min_dp} after waiting "
                           f"{now - started:.0f} s for capacity")


def grow_target(mesh: MeshShape, spec_mesh: MeshShape, topology: Topology, global_batch: int,
                micro_batch: int) -> MeshShape | None:
    """The larger mesh the healthy nodes allow now, up to the spec's; None when nothing to grow."""
    if mesh.dp >= spec_mesh.dp:
        return None
    dp = largest_dp(spec_mesh, topology, global_batch, micro_batch)
    if dp > mesh.dp:
        return MeshShape(dp=dp, pp=mesh.pp, tp=mesh.tp)
    return None
