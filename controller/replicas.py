"""failure_domain replica, the controller's side (DESIGN.md, "Failure domains"): a failure that stops
only the data-parallel replicas it touched is contained, their nodes are taken out (quarantined for
a contained SDC), and the replicas are formed again on spares or idle healthy nodes while the others
train on. `ReplicaDomain` holds which replicas are out, which are being formed, and when the
survivors' stall began; the run controller (controller/state.py) owns one and stays the one authority
on membership: it records the failures, and applies the topology and placement this module returns.
Never import the controller: what the domain needs is handed to it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from controller.attempt import WorkerGroup
from controller.attribution import AttemptWatch
from controller.events import EventKind, EventLog
from controller.failure_policy import Action, FailureCause, FailureEvent
from controller.placement import Placement, ranks_on, swap_nodes
from controller.spec import ElasticSpec
from controller.topology import NodeState, Topology, merge_returned
from trainer.config import MeshShape
from trainer.protocol import form_order
from trainer.report import StepReport


def ranks_of(replicas: Iterable[int], mesh: MeshShape) -> set[int]:
    """Every rank of these data-parallel replicas."""
    per = mesh.world_size // mesh.dp_replicas
    return {r for replica in replicas for r in range(replica * per, (replica + 1) * per)}


@dataclass(frozen=True, kw_only=True)
class Containment:
    """A failure the replica domain contains (`ReplicaDomain.contains`)."""

    ranks: frozenset[int]
    """The failure's ranks: its own and those on its nodes."""
    lost: tuple[int, ...]
    """The replicas it stops now; none: news of replicas already out (nothing more stops)."""
    live: int
    """The replicas that train on."""


@dataclass(frozen=True, kw_only=True)
class Formation:
    """Where the waiting replicas form again (`ReplicaDomain.formation`)."""

    replicas: tuple[int, ...]
    """The replicas that form now; none: no node can take them yet (they stay out)."""
    topology: Topology
    """The run's topology with the cluster's returned nodes, and the nodes they take as healthy."""
    placement: Placement
    """The attempt's placement with their lost nodes swapped for the ones they take."""


class ReplicaDomain:
    """The replicas of the running attempt that are out, and their way back in: contained (`contains`,
    then `take_out`), formed again (`formation`, then `form`), rejoined (`rejoined`). A new attempt
    starts with all of them in (`reset`); a restarted service `adopt`s the ones its timeline shows out.
    Each way out and in is a verdict, then the act: between the two the controller records the failure
    (its timeline says the failure before the decision) or applies the new placement (it is the run's
    while the slow call to the worker group runs)."""

    def __init__(self, events: EventLog, group: WorkerGroup, elastic: ElasticSpec,
                 outside_lock: Callable[[], AbstractContextManager[Any]]) -> None:
        self._events = events
        self._group: Any = group
        """Its replica methods are optional (controller/attempt.py): looked up before they are called."""
        self._elastic = elastic
        self._outside_lock = outside_lock
        """Entered around the worker group's calls (they may be slow: the controller's lock is let go)."""
        self.out: dict[int, tuple[str, ...]] = {}
        """The data-parallel replicas of this attempt not training now, and the nodes each lost (to be
        replaced before it can be formed again)."""
        self.forming: set[int] = set()
        """Of those, the ones being formed again (their group reports `replica_rejoined`)."""
        self.survivors_since: float | None = None
        """When the survivors were told to go on without lost replicas (their next step is the recovery)."""
        self._no_room: tuple[Any, ...] | None = None
        """What the last `formation` that found no room for the waiting replicas looked at (asked at every
        poll while they wait: at 16,384 nodes, a pass over them each time), to answer the same again."""

    def reset(self) -> None:
        """A new attempt: every replica trains."""
        self.out, self.forming, self.survivors_since, self._no_room = {}, set(), None, None

    def adopt(self, out: Mapping[int, tuple[str, ...]], mesh: MeshShape) -> tuple[set[str], set[int]]:
        """A restarted service's attempt, with the replicas it lost and had not formed again (replica ->
        the nodes they lost), formed again from here as after any loss. Returns those nodes (lost to
        the run) and the replicas' ranks (not heard from until they rejoin)."""
        self.out = dict(out)
        return {n for nodes in out.values() for n in nodes}, ranks_of(out, mesh)

    def waiting(self) -> list[int]:
        """The replicas out and not being formed, in replica order."""
        return sorted(set(self.out) - self.forming)

    def contains(self, failure: FailureEvent, *, mesh: MeshShape, placement: Placement,
                 failures: int) -> Containment | None:
        """Whether this failure (the run's `failures`+1st, if it counts) stops only the data-parallel
        replicas it touched: if others live on and the worker group can go on without them. None:
        stop the world."""
        lose = getattr(self._group, "lose_replicas", None)
        contains = getattr(self._group, "contains_replicas", None)  # this attempt's replicas, as launched
        if (self._elastic.failure_domain != "replica" or mesh.dp_replicas < 2 or lose is None
                or contains is None or not contains()
                or not (failure.cause in (FailureCause.NODE_LOST, FailureCause.RANK_DIED, FailureCause.WORKER_ERROR,
                                          FailureCause.COLLECTIVE_ERROR, FailureCause.DRAINED)
                        or (failure.cause is FailureCause.SDC and failure.contained and failure.ranks))
                or (failure.cause is not FailureCause.DRAINED and failures + 1 > self._elastic.max_failures)):
            return None
        per = mesh.world_size // mesh.dp_replicas
        ranks = frozenset(failure.ranks) | frozenset(ranks_on(placement.node_of_rank, failure.nodes))
        # A replica out and waiting has no processes (its ranks still name its lost nodes); one being
        # formed again (or joining, until its rejoin) is lost again: it forms once more elsewhere.
        waiting = set(self.waiting())
        touched = {r // per for r in ranks}
        live = mesh.dp_replicas - len(set(self.out) | touched)
        if touched and touched <= waiting:
            return Containment(ranks=ranks, lost=(), live=live)
        lost = tuple(sorted(touched - waiting))
        if not lost or live < 1:
            return None
        return Containment(ranks=ranks, lost=lost, live=live)

    def take_out(self, now: float, failure: FailureEvent, containment: Containment, *, attempt: int,
                 mesh: MeshShape, placement: Placement, watch: AttemptWatch) -> None:
        """The contained replicas stop (the controller has recorded the failure): the survivors go on
        now, and the lost replicas wait to be formed again on other nodes (`formation`)."""
        lost, live = list(containment.lost), containment.live
        for replica in lost:  # (formed again already: its nodes now are those it took)
            self.out[replica] = tuple(sorted({placement.node_of_rank[r] for r in ranks_of([replica], mesh)}
                                             & set(failure.nodes)))
            self.forming.discard(replica)
        batch = self._elastic.batch_while_healing
        self._events.add(now, attempt, EventKind.DECISION, action=Action.HEAL_REPLICA.value, code="replica_out",
                         reason=f"{failure.cause.value} on {list(failure.nodes) or list(failure.ranks)}: replica(s) "
                                f"{lost} stop, {live} of {mesh.dp_replicas} train on ({batch} the global batch) "
                                "and the lost ones are formed again", mesh=mesh.axes(), dp_replicas=mesh.dp_replicas)
        watch.contained(set(containment.ranks) | ranks_of(lost, mesh))
        with self._outside_lock():  # (the worker group may say when the survivors were told: Unix seconds)
            told_at = self._group.lose_replicas(lost, tuple(failure.nodes), suspect=failure.cause is FailureCause.SDC)
        self._events.add(now, attempt, EventKind.REPLICA_LOST, replicas=lost, nodes=list(failure.nodes), live=live,
                         of=mesh.dp_replicas, batch=batch,
                         **({"told_at": told_at} if told_at is not None else {}))
        self.survivors_since = now

    def formation(self, topology: Topology, placement: Placement, *,
                  cluster: Callable[[], Topology | None] | None) -> Formation | None:
        """Where the waiting replicas form again, once spares (or their own nodes, back: `cluster` says
        what the cluster holds now) can take the places of the nodes they lost; the live replicas stay
        where they are. None: none waits, the worker group cannot form replicas, or the cluster did not
        answer (`cluster` gave None: they wait for the next poll)."""
        waiting = self.waiting()
        if not waiting or getattr(self._group, "form_replicas", None) is None:
            return None
        if cluster is not None:
            if (shown := cluster()) is None:
                return None
            topology = merge_returned(topology, shown)
        looked_at = (tuple((r, self.out[r]) for r in waiting), topology, placement)
        last = self._no_room  # (topologies and placements are immutable: the same objects, the same answer)
        if last is not None and last[0] == looked_at[0] and last[1] is topology and last[2] is placement:
            return Formation(replicas=(), topology=topology, placement=placement)  # (nothing changed since)
        healthy = topology.names_in(NodeState.HEALTHY)
        missing = {replica: [n for n in self.out[replica] if n not in healthy] for replica in waiting}
        used = placement.rack_of_node
        # spares first, then healthy nodes the run does not use (repaired ones, or a replaced node back);
        # as many replicas form as there are nodes for, in replica order (the others stay out)
        free = [s.name for s in topology.spares()]
        free += [n for n in topology.in_node_order(healthy - used.keys()) if n not in free]
        plan = form_order(waiting, missing, free)
        if not plan:  # degraded until a spare or a repaired node can take them
            self._no_room = looked_at
            return Formation(replicas=(), topology=topology, placement=placement)
        self._no_room = None
        swaps = {node: spare for replica in sorted(plan) for node, spare in plan[replica].items()}
        topology = topology.with_states({s: NodeState.HEALTHY for s in swaps.values()})
        return Formation(replicas=tuple(sorted(plan)), topology=topology,
                         placement=swap_nodes(placement, swaps, topology))

    def form(self, now: float, formation: Formation, watch: AttemptWatch) -> FailureEvent | None:
        """Form the replicas of `formation` again where its placement (now the attempt's) puts them;
        the failure to recover from on the world path if the worker group cannot."""
        if not formation.replicas:
            return None
        waiting = list(formation.replicas)
        watch.moved(formation.placement.node_of_rank)
        self.forming |= set(waiting)
        try:
            with self._outside_lock():
                self._group.form_replicas(waiting, formation.placement)
        except Exception as e:  # noqa: BLE001 - they cannot be formed here: the world path takes over
            return FailureEvent(time=now, cause=FailureCause.WORKER_ERROR, message=(
                f"replica(s) {waiting} could not be formed again: {type(e).__name__}: {e}"))
        return None

    def rejoined(self, replicas: Iterable[Any]) -> None:
        """These replicas train again (their group said `replica_rejoined`)."""
        for replica in replicas:
            self.out.pop(int(replica), None)
            self.forming.discard(int(replica))

    def resynced(self, now: float) -> None:
        """The survivors resynchronised their collectives: their first step after is the recovery."""
        if self.survivors_since is None:
            self.survivors_since = now

    def survivors_stepped(self, now: float, attempt: int, reports: list[StepReport]) -> None:
        """The survivors' first step begun after their stall began ends it (`first_step_after_recovery`)."""
        if self.survivors_since is None:
            return
        after = [r for r in reports if r.end_time - r.step_time_s >= self.survivors_since]
        if after:
            self._events.add(now, attempt, EventKind.FIRST_STEP_AFTER_RECOVERY, step=after[0].step,
                             ended_at=min(after[0].end_time, now), survivors=True)
            self.survivors_since = None
