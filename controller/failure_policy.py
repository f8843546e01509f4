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
from dataclasses import dataclass, field, replace
from typing import Callable

from controller.placement import Placement, PlacementError, place, reseat
from controller.topology import NodeState, Topology, merge_returned
from trainer.config import MeshShape


class FailureCause(str, enum.Enum):
    NODE_LOST = "node_lost"
    RANK_DIED = "rank_died"
    HANG = "hang"
    COLLECTIVE_ERROR = "collective_error"
    WORKER_ERROR = "worker_error"
    SDC = "sdc"
    STRAGGLER = "straggler"
    CONTROLLER_ERROR = "controller_error"
    """An exception inside the controller (a bug): the attempt it was handling ends and starts again."""
    FINAL_SAVE_FAILED = "final_save_failed"
    """Every rank finished but the last step's checkpoint did not commit (the store refused it past
    the retry budget): the run is not done until its final state is saved."""
    DRAINED = "drained"
    """Not a failure: a planned departure (an operator's drain, a node tainted for deletion or spot
    reclaim, a SIGTERM). The ranks stopped at a step boundary with their state kept; the node's ranks
    are reseated like a lost node's, and nothing is charged to elastic.max_failures."""

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
    contained: bool = False
    """SDC under failure_domain replica: the corruption reached only the named ranks' replicas (the
    others' state is vouched), so healing them is enough."""


class Action(str, enum.Enum):
    REPLACE = "replace"
    SHRINK = "shrink"
    RESTART = "restart"
    WAIT = "wait"
    GROW = "grow"
    FAIL = "fail"
    HEAL_REPLICA = "heal_replica"
    """Only the failed data-parallel replicas stop; they are formed again while the others train."""


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
    code: str
    """Machine-readable outcome: replaced, restarted, shrunk, grown, waiting_for_capacity, and for FAIL
    the run's error code (failure_budget, no_capacity)."""
    placement: Placement | None = None
    """The placement of `mesh` on `topology` when the policy already made it (the controller reuses it)."""


Fits = Callable[[MeshShape], "str | None"]
"""A mesh -> None when its per-GPU memory fits the GPUs, else why not (the planner's memory model)."""


@dataclass(frozen=True, kw_only=True)
class ElasticLimits:
    min_dp: int
    """Smallest dp a run may shrink to."""
    max_failures: int
    """Failures after which the run fails."""
    wait_for_capacity_s: float = 300.0
    """How long to wait below min_dp before failing."""


def with_dp(mesh: MeshShape, dp: int, by_replica: bool = False) -> MeshShape:
    """`mesh` at `dp`: HSDP keeps its dp_replicas (each replica shards over fewer ranks); under
    failure_domain replica (`by_replica`) each replica keeps its dp_shard and whole replicas go."""
    if by_replica:
        return replace(mesh, dp=dp, dp_replicas=max(dp // (mesh.dp // mesh.dp_replicas), 1))
    return replace(mesh, dp=dp)


def _keeps_layout(mesh: MeshShape, dp: int, by_replica: bool) -> bool:
    return dp % (mesh.dp // mesh.dp_replicas if by_replica else mesh.dp_replicas) == 0


def largest_dp(mesh: MeshShape, topology: Topology, global_batch: int, micro_batch: int,
               fits: Fits | None = None, by_replica: bool = False) -> int:
    """Largest dp <= mesh.dp that keeps the layout (a multiple of HSDP's dp_replicas; under
    `by_replica`, of a replica's dp_shard), divides the batch, fits each GPU's memory and has a
    feasible placement on healthy nodes; 0 if none."""
    return _largest(mesh, topology, global_batch, micro_batch, fits, by_replica)[0]


def _largest(mesh: MeshShape, topology: Topology, global_batch: int, micro_batch: int,
             fits: Fits | None, by_replica: bool = False) -> tuple[int, Placement | None]:
    """largest_dp, and the placement that proved it."""
    gpus = int(topology.usable_columns().num_gpus.sum())
    for dp in range(mesh.dp, 0, -1):
        if not _keeps_layout(mesh, dp, by_replica) or global_batch % (dp * micro_batch) or dp * mesh.pp * mesh.tp > gpus:
            continue  # (more ranks than healthy GPUs cannot place: no need to try)
        candidate = with_dp(mesh, dp, by_replica)
        if fits is not None and fits(candidate) is not None:
            continue
        try:
            return dp, place(candidate, topology)
        except PlacementError:
            continue
    return 0, None


def _layout_note(mesh: MeshShape, dp: int, topology: Topology, global_batch: int, micro_batch: int,
                 fits: Fits | None, by_replica: bool = False) -> str:
    """Why a smaller dp than the GPUs would allow was taken (HSDP's replicas, memory per GPU), or ''."""
    notes = []
    if mesh.dp_replicas > 1 and not by_replica:
        plain = largest_dp(replace(mesh, dp_replicas=1), topology, global_batch, micro_batch, fits)
        notes.append(f"HSDP dp_replicas {mesh.dp_replicas} kept, so dp stays a multiple of it"
                     + (f" (dp {plain} would fit without it)" if plain > dp else ""))
    if fits is not None:
        for bigger in range(mesh.dp, dp, -1):
            if _keeps_layout(mesh, bigger, by_replica) and not global_batch % (bigger * micro_batch):
                why = fits(with_dp(mesh, bigger, by_replica))
                if why is not None:
                    notes.append(f"dp {bigger} does not fit: {why}")
                    break
    return "; ".join(notes)


def decide(now: float, *, event: FailureEvent, failures_so_far: int, mesh: MeshShape, spec_mesh: MeshShape,
           topology: Topology, limits: ElasticLimits, global_batch: int, micro_batch: int,
           waiting_since: float | None = None, fits: Fits | None = None, by_replica: bool = False,
           placement: Placement | None = None) -> Decision:
    """`failures_so_far` counts earlier failures of the run (this one excluded); `placement`, the
    failed attempt's: a next attempt on the same mesh keeps it where its nodes are still healthy (a
    restart: all of it; a replacement: every rank but the lost nodes', `reseat`). A drain (a planned
    departure) is decided alike but charged nothing."""
    charged = event.cause is not FailureCause.DRAINED
    failures = failures_so_far + int(charged)
    for node in event.nodes:
        topology = topology.with_state(node, NodeState.QUARANTINED if event.cause.quarantines else NodeState.LOST)
    if charged and failures > limits.max_failures:
        return Decision(action=Action.FAIL, mesh=None, topology=topology, code="failure_budget",
                        reason=f"{failures} failures exceed elastic.max_failures = {limits.max_failures}")
    lost_in_use = list(event.nodes)
    lost = "quarantined" if event.cause.quarantines else "drained" if not charged else "lost"
    if not event.nodes:
        # A rank died or hung on a node that is still alive: the same mesh on the same nodes...
        healthy = topology.names_in(NodeState.HEALTHY)
        same = placement if placement is not None and placement.mesh == mesh else None
        if same is None or same.nodes() <= healthy:
            return Decision(action=Action.RESTART, mesh=mesh, topology=topology, code="restarted",
                            reason=f"{event.cause.value} on ranks {list(event.ranks)}; nodes still healthy",
                            placement=same)
        # ...unless some of them are not healthy any more (a replica out with its node lost, when another
        # fails to form; a node quarantined since): those are replaced as after their loss.
        lost_in_use = topology.in_node_order(same.nodes() - healthy)
        lost = f"{event.cause.value}; not healthy:"
    spares = topology.spares()
    if len(spares) >= len(lost_in_use):
        promoted = []
        with_spares = topology
        for spare in spares[: len(lost_in_use)]:
            with_spares = with_spares.with_state(spare.name, NodeState.HEALTHY)
            promoted.append(spare.name)
        try:
            return Decision(action=Action.REPLACE, mesh=mesh, topology=with_spares, code="replaced",
                            reason=f"{lost} {lost_in_use}; spare {promoted} takes over, mesh unchanged",
                            placement=_kept(placement, mesh, with_spares, lost_in_use, promoted)
                            or place(mesh, with_spares))
        except PlacementError:
            topology = with_spares  # spares too small for the mesh: shrink onto them and the rest
    decision = capacity_decision(now, mesh=mesh, topology=topology, limits=limits, global_batch=global_batch,
                                 micro_batch=micro_batch, waiting_since=waiting_since, fits=fits,
                                 cause=f"{lost} {lost_in_use}, no spare", by_replica=by_replica)
    kept = _kept(placement, decision.mesh, decision.topology, lost_in_use) if decision.action is Action.REPLACE else None
    return replace(decision, placement=kept) if kept is not None else decision


def _kept(placement: Placement | None, mesh: MeshShape | None, topology: Topology, lost: list[str],
          candidates: list[str] | None = None) -> Placement | None:
    """The failed attempt's placement with only the lost nodes' ranks moved, when the mesh is unchanged
    and replacements exist (else None: a fresh placement)."""
    if placement is None or mesh is None or placement.mesh != mesh:
        return None
    return reseat(placement, topology, lost, candidates)


def capacity_decision(now: float, *, mesh: MeshShape, topology: Topology, limits: ElasticLimits,
                      global_batch: int, micro_batch: int, waiting_since: float | None, fits: Fits | None = None,
                      cause: str, target: MeshShape | None = None, by_replica: bool = False) -> Decision:
    """The mesh the healthy nodes hold now: shrink (or grow back, up to `target`) keeping pp, tp, the
    layout and the global batch; below min_dp wait for capacity, then fail once the wait is over."""
    start = target or mesh
    dp, placement = _largest(start, topology, global_batch, micro_batch, fits, by_replica)
    note = _layout_note(start, dp, topology, global_batch, micro_batch, fits, by_replica)
    note = f"; {note}" if note else ""
    if target is None and dp == mesh.dp:  # idle healthy nodes (not spares: returned from repair) hold it
        return Decision(action=Action.REPLACE, mesh=mesh, topology=topology, code="replaced", placement=placement,
                        reason=f"{cause}: idle healthy nodes take over, mesh unchanged{note}")
    if dp >= limits.min_dp:
        new = with_dp(start, dp, by_replica)
        grow = target is not None and dp >= mesh.dp
        return Decision(action=Action.GROW if grow else Action.SHRINK, mesh=new, topology=topology,
                        code="grown" if grow else "shrunk", placement=placement,
                        reason=f"{cause}: dp {mesh.dp} -> {dp} (pp{mesh.pp} tp{mesh.tp} kept, "
                               f"{global_batch // (dp * micro_batch)} micro-batches per step keep global batch "
                               f"{global_batch}){note}")
    started = waiting_since if waiting_since is not None else now
    if now - started < limits.wait_for_capacity_s:
        return Decision(action=Action.WAIT, mesh=None, topology=topology, code="waiting_for_capacity",
                        reason=f"{cause}: healthy GPUs allow dp {dp} < elastic.min_dp = {limits.min_dp}; waiting "
                               f"up to {limits.wait_for_capacity_s:.0f} s for capacity{note}")
    return Decision(action=Action.FAIL, mesh=None, topology=topology, code="no_capacity",
                    reason=f"no capacity for dp >= {limits.min_dp} after {limits.wait_for_capacity_s:.0f} s ({cause}): "
                           f"healthy GPUs allow dp {dp} after waiting {now - started:.0f} s for capacity{note}")


def grow_target(mesh: MeshShape, spec_mesh: MeshShape, topology: Topology, global_batch: int,
                micro_batch: int, fits: Fits | None = None, by_replica: bool = False) -> MeshShape | None:
    """The larger mesh the healthy nodes allow now, up to the spec's; None when nothing to grow."""
    if mesh.dp >= spec_mesh.dp:
        return None
    dp = largest_dp(spec_mesh, topology, global_batch, micro_batch, fits, by_replica)
    if dp > mesh.dp:
        return with_dp(spec_mesh, dp, by_replica) if by_replica else replace(mesh, dp=dp)
    return None


def grow_decision(mesh: MeshShape, spec_mesh: MeshShape, topology: Topology, *, global_batch: int, micro_batch: int,
                  fits: Fits | None, step: int, by_replica: bool = False) -> Decision | None:
    """Grow back at a checkpoint boundary when the healthy nodes hold a larger mesh (up to the spec's):
    nodes returned, the run takes them (no step is lost). None when there is nothing to grow into."""
    target = grow_target(mesh, spec_mesh, topology, global_batch, micro_batch, fits, by_replica)
    if target is None:
        return None
    return Decision(action=Action.GROW, mesh=target, topology=topology, code="grown",
                    reason=f"capacity returned: dp {mesh.dp} -> {target.dp} at the step-{step} checkpoint")


@dataclass(frozen=True, kw_only=True)
class RunPolicy:
    """One run's decisions, given what they depend on besides the failure: its elastic limits, its
    batch, the mesh its spec fixes (None: the planner's), and the memory model."""

    limits: ElasticLimits
    global_batch: int
    micro_batch: int
    spec_mesh: MeshShape | None
    fits: Fits | None = None
    by_replica: bool = False
    """failure_domain replica: a smaller mesh has fewer whole replicas (each keeps its dp_shard)."""

    def on_failure(self, now: float, event: FailureEvent, *, failures_so_far: int, mesh: MeshShape,
                   topology: Topology, waiting_since: float | None, placement: Placement | None = None) -> Decision:
        return decide(now, event=event, failures_so_far=failures_so_far, mesh=mesh, spec_mesh=self.spec_mesh or mesh,
                      topology=topology, limits=self.limits, global_batch=self.global_batch,
                      micro_batch=self.micro_batch, waiting_since=waiting_since, fits=self.fits,
                      by_replica=self.by_replica, placement=placement)

    def on_capacity(self, now: float, *, mesh: MeshShape, topology: Topology, waiting_since: float | None) -> Decision:
        """Waiting for capacity: launch once the healthy nodes hold dp >= min_dp again; fail once the wait is over."""
        return capacity_decision(now, mesh=mesh, topology=topology, limits=self.limits, global_batch=self.global_batch,
                                 micro_batch=self.micro_batch, waiting_since=waiting_since, fits=self.fits,
                                 target=self.spec_mesh or mesh, by_replica=self.by_replica,
                                 cause=f"after waiting {now - (waiting_since or now):.0f} s")

    def may_grow(self, mesh: MeshShape) -> bool:
        return mesh.dp < (self.spec_mesh or mesh).dp

    def on_commit(self, mesh: MeshShape, topology: Topology, *, step: int) -> Decision | None:
        """At a checkpoint boundary: grow back towards the spec's mesh if the nodes allow it."""
        return grow_decision(mesh, self.spec_mesh or mesh, topology, global_batch=self.global_batch,
                             micro_batch=self.micro_batch, fits=self.fits, step=step, by_replica=self.by_replica)


class GrowWatch:
    """Whether a shrunk run's nodes changed since it last looked: the same usable nodes cannot hold a
    bigger mesh now than they did then (a grow check costs a planning pass; runs check at every commit)."""

    def __init__(self) -> None:
        self._inputs: tuple[Topology, Topology] | None = None
        self._usable: tuple[frozenset[str], frozenset[str]] | None = None
        """(every node, the nodes neither healthy nor spare) when last returned: the usable nodes are
        the first less the second, compared without building them (16,384 names, at every commit)."""

    def changed(self, topology: Topology, live: Topology) -> Topology | None:
        """The run's nodes with those returned from the `live` cluster, when their usable nodes differ
        from the last call that returned them; else None."""
        if self._inputs is not None and self._inputs[0] is topology and self._inputs[1] is live:
            return None  # the same objects: the same answer
        self._inputs = (topology, live)
        merged = merge_returned(topology, live)
        names = merged.names  # (carried from topology to topology: the same set, mostly the same object)
        unusable = frozenset().union(*(merged.names_in(state) for state in NodeState
                                       if state not in (NodeState.HEALTHY, NodeState.SPARE)))
        last = self._usable
        if last is not None and (last[0] is names or last[0] == names) and last[1] == unusable:
            return None
        self._usable = (names, unusable)
        return merged


def taken_out(before: Topology, decision: Decision, failure: FailureEvent | None) -> list[dict]:
    """The `quarantined` event detail of each node the decision takes out of the run: lost nodes, and
    nodes quarantined on the failure's evidence."""
    out: list[dict] = []
    after = decision.topology
    changed = {name: state for state in (NodeState.LOST, NodeState.QUARANTINED)
               for name in after.names_in(state) - before.names_in(state) if name in before}
    for name in before.in_node_order(changed):
        if changed[name] is NodeState.LOST:
            if failure is None or failure.cause is not FailureCause.DRAINED:  # (a drain's `drained` event names them)
                out.append({"node": name, "reason": "lost"})
        else:
            out.append({"node": name, "reason": failure.cause.value if failure else "quarantined",
                        "ranks": list(failure.ranks) if failure else [], "message": failure.message if failure else "",
                        "evidence": dict(failure.evidence) if failure else {}})
    return out
