"""failure_domain replica, the controller's side (DESIGN.md, "Failure domains"): a failure that stops
only the data-parallel replicas it touched is contained (`contain`), their nodes are taken out
(quarantined for a contained SDC), and the replicas are formed again on spares or idle healthy nodes
while the others train on (`form_replicas`). Functions of the RunController they act for
(controller/state.py), which stays the one authority on membership."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.events import EventKind
from controller.failure_policy import Action, FailureCause, FailureEvent
from controller.placement import ranks_on, swap_nodes
from controller.topology import NodeState, merge_returned
from trainer.protocol import form_order

if TYPE_CHECKING:
    from controller.state import RunController


def contain(c: "RunController", now: float, failure: FailureEvent) -> bool:
    """failure_domain replica: a lost node (or a dead rank) stops only the data-parallel replicas it
    held, if others live on and the worker group can go on without them. The survivors go on now;
    the lost replicas are formed again on spares (`form_replicas`). False: stop the world."""
    assert c.config is not None and c.placement is not None
    mesh = c.config.mesh
    lose = getattr(c.worker_group, "lose_replicas", None)
    contains = getattr(c.worker_group, "contains_replicas", None)  # this attempt's replicas, as launched
    if (c.spec.elastic.failure_domain != "replica" or mesh.dp_replicas < 2 or lose is None
            or contains is None or not contains()
            or not (failure.cause in (FailureCause.NODE_LOST, FailureCause.RANK_DIED, FailureCause.WORKER_ERROR,
                                      FailureCause.COLLECTIVE_ERROR)
                    or (failure.cause is FailureCause.SDC and failure.contained and failure.ranks))
            or len(c.failures) + 1 > c.spec.elastic.max_failures):
        return False
    per = mesh.world_size // mesh.dp_replicas
    ranks = set(failure.ranks) | set(ranks_on(c.placement.node_of_rank, failure.nodes))
    # A replica out and waiting has no processes (its ranks still name its lost nodes); one being
    # formed again (or joining, until its rejoin) is lost again: it forms once more elsewhere.
    waiting = set(c.replicas_out) - c._forming
    touched = {r // per for r in ranks}
    if touched and touched <= waiting:  # (news of replicas already out: nothing more stops)
        assert c.watch is not None
        c.watch.contained(ranks)
        return True
    lost = sorted(touched - waiting)
    live = mesh.dp_replicas - len(set(c.replicas_out) | set(lost))
    if not lost or live < 1:
        return False
    c.events.add(now, c.attempt, EventKind.FAILURE_DETECTED, cause=failure.cause.value, nodes=list(failure.nodes),
                    ranks=list(failure.ranks), message=failure.message, step=c.progress.step, replicas=lost)
    c._last_failure = failure
    c.failures.append(failure)
    state = NodeState.QUARANTINED if failure.cause.quarantines else NodeState.LOST
    c.topology = c.topology.with_states({n: state for n in failure.nodes})
    if failure.cause.quarantines:
        quarantine_contained(c, now, failure)
    nodes_of = {replica: tuple(sorted({c.placement.node_of_rank[r] for r in range(replica * per, (replica + 1) * per)}
                                      & set(failure.nodes))) for replica in lost}
    for replica in lost:
        c.replicas_out[replica] = nodes_of[replica]  # (formed again already: its nodes now are those it took)
        c._forming.discard(replica)
    c.events.add(now, c.attempt, EventKind.DECISION, action=Action.HEAL_REPLICA.value, code="replica_out",
                    reason=f"{failure.cause.value} on {list(failure.nodes) or list(failure.ranks)}: replica(s) {lost} "
                           f"stop, {live} of {mesh.dp_replicas} train on ({c.spec.elastic.batch_while_healing} "
                           "the global batch) and the lost ones are formed again", mesh=mesh.axes(),
                    dp_replicas=mesh.dp_replicas)
    assert c.watch is not None
    c.watch.contained(ranks | {r for replica in lost for r in range(replica * per, (replica + 1) * per)})
    with c.outside_lock():  # (the worker group may say when the survivors were told: Unix seconds)
        told_at = lose(lost, tuple(failure.nodes), suspect=failure.cause is FailureCause.SDC)
    c.events.add(now, c.attempt, EventKind.REPLICA_LOST, replicas=lost, nodes=list(failure.nodes), live=live,
                 of=mesh.dp_replicas, batch=c.spec.elastic.batch_while_healing,
                 **({"told_at": told_at} if told_at is not None else {}))
    c._survivors_since = now
    form_replicas(c, now)
    return True


def quarantine_contained(c: "RunController", now: float, failure: FailureEvent) -> None:
    """A contained SDC: its nodes get no rank again (the replica forms on others), and commits
    after the last step the replicas agreed on are not loaded again (the suspect may have saved)."""
    for node in failure.nodes:
        detail = {"node": node, "reason": failure.cause.value, "ranks": list(failure.ranks),
                  "message": failure.message, "evidence": dict(failure.evidence)}
        c.events.add(now, c.attempt, EventKind.QUARANTINED, **detail)
        c.quarantined.append({"node": node, "reason": detail["reason"], "evidence": detail["evidence"], "time": now})
    through = c.watch.take_rollback() if c.watch is not None else None
    if through is not None:
        with c.outside_lock():
            c._discarded(now, c.checkpoints.roll_back(through))


def form_replicas(c: "RunController", now: float) -> None:
    """Form the replicas that are out again, once spares (or their own nodes, back) can take the
    places of the nodes they lost; the live replicas stay where they are."""
    waiting = sorted(set(c.replicas_out) - c._forming)
    form = getattr(c.worker_group, "form_replicas", None)
    if not waiting or form is None or c.placement is None:
        return
    if c.topology_source is not None:
        c.topology = merge_returned(c.topology, c.topology_source())
    healthy = c.topology.names_in(NodeState.HEALTHY)
    missing = {replica: [n for n in c.replicas_out[replica] if n not in healthy] for replica in waiting}
    used = c.placement.rack_of_node
    # spares first, then healthy nodes the run does not use (repaired ones, or a replaced node back);
    # as many replicas form as there are nodes for, in replica order (the others stay out)
    free = [s.name for s in c.topology.spares()]
    free += [n for n in c.topology.in_node_order(healthy - used.keys()) if n not in free]
    plan = form_order(waiting, missing, free)
    if not plan:
        return  # degraded until a spare or a repaired node can take them
    waiting = sorted(plan)
    swaps = {node: spare for replica in waiting for node, spare in plan[replica].items()}
    c.topology = c.topology.with_states({s: NodeState.HEALTHY for s in swaps.values()})
    c.placement = swap_nodes(c.placement, swaps, c.topology)
    assert c.watch is not None
    c.watch.moved(c.placement.node_of_rank)
    c._forming |= set(waiting)
    try:
        with c.outside_lock():
            form(waiting, c.placement)
    except Exception as e:  # noqa: BLE001 - they cannot be formed here: the world path takes over
        failure = FailureEvent(time=now, cause=FailureCause.WORKER_ERROR, message=(
            f"replica(s) {waiting} could not be formed again: {type(e).__name__}: {e}"))
        c._recover(now, failure, contain=False)
