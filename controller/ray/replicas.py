"""failure_domain replica on Ray (controller/replicas.py decides, this acts): the attempt's membership
epochs in the run's store, a lost replica's training processes ended and forked again from warm
actors of the nodes that take its place, and the epoch that lets it join published once every one
of its ranks has built its replica's world. Functions of the RayWorkerGroup they act for."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from trainer.protocol import Roster

if TYPE_CHECKING:
    from controller.attempt import AttemptSpec
    from controller.ray.worker_group import RayWorkerGroup


def lose_replicas(group: "RayWorkerGroup", replicas: list[int], nodes: tuple[str, ...], *,
                  suspect: bool = False) -> float:
    """The controller's word: these replicas are out. Their training processes on live nodes end
    (a node loss ended the others), and the next membership epoch, without them, lets the survivors
    go on (when they were told, Unix seconds, is returned). `suspect` (a contained SDC): their peer snapshots on their nodes go too, since they may hold
    the corruption; a lost replica's snapshots are otherwise the state every replica held at their
    step, kept for the world path's fallback."""
    import time

    import ray

    r = group._replicas
    assert r is not None and group._attempt is not None
    ranks = [rank for replica in replicas for rank in r.ranks(replica) if rank not in r.out]
    group._gone |= set(nodes) & set(group._node_of_rank) if not suspect else set()
    gone = group.on_gone_nodes(ranks)  # (not waited for: a dark node answers nothing)
    stops = [group.actors[rank].stop.remote() for rank in ranks if group.actors[rank] is not None and rank not in gone]
    membership = r.roster.lose(replicas)  # (NotContainable: no replica holding the state is left; nothing changed)
    group._failed -= set(ranks)
    group._nodes = {node for rank, node in enumerate(group._node_of_rank) if rank not in r.out}
    for rank in ranks:
        group._drains.pop(rank, None)
    # The survivors first: the lost replica's ranks are not members of the new epoch (nothing of
    # theirs reaches its groups, and a rank that finds its epoch superseded ends), so its stops are
    # waited for after the survivors are told, before any of its actors is used again. (A replica
    # lost while it formed was no member: no epoch changes.)
    if membership is not None:
        r.board.publish(membership)
    told = time.time()
    ray.wait(stops, num_returns=len(stops), timeout=15)
    if suspect and group._attempt.peer_every and group._peer_key is not None:  # (an SDC's nodes are alive)
        held_by = {group._node_of_rank[rank] for rank in ranks}
        drops = [group._pool[node][0].drop_peer_copies.remote(group._peer_key) for node in held_by if group._pool.get(node)]
        ray.wait(drops, num_returns=len(drops), timeout=15)
    return told


def form_replicas(group: "RayWorkerGroup", replicas: list[int], placement: Any) -> None:
    """Form `replicas` again where `placement` puts them: a training process per rank, forked from
    a warm actor of its (new) node; once every one has built its replica's world, the next epoch
    lists them as joining and a live replica gives them its state (`poll` publishes it)."""
    r = group._replicas
    assert r is not None and group._attempt is not None
    group._attempt = dataclasses.replace(group._attempt, placement=placement)
    group._node_of_rank = tuple(placement.node_of_rank)
    if group._hearts is not None:
        group._hearts.moved(group._node_of_rank)
    busy = {id(a) for rank, a in enumerate(group.actors) if rank not in r.out and a is not None}
    _warm_for(group, [placement.node_of_rank[rank] for k in replicas for rank in r.ranks(k)], busy)
    for replica in replicas:
        incarnation = r.incarnation.get(replica, 0) + 1
        r.incarnation[replica] = incarnation
        for rank in r.ranks(replica):
            node = placement.node_of_rank[rank]
            actor = next((a for a in group._pool.get(node, []) if id(a) not in busy), None)
            if actor is None:
                raise RuntimeError(f"no idle warm actor on {node} for rank {rank} of replica {replica}")
            busy.add(id(actor))
            group.actors[rank] = actor
            group._runs[rank] = actor.run.remote(group._worker_args(group._attempt, rank, incarnation))
            group._finished.discard(rank)
        r.roster.form(replica, incarnation)
    # The nodes the attempt runs on now; a replica still out keeps naming its lost nodes, which are
    # not asked about again (a dead one would be found dead at every poll: the attempt never ends).
    group._nodes = {node for rank, node in enumerate(group._node_of_rank) if rank not in r.out}


def _warm_for(group: "RayWorkerGroup", nodes: list[str], busy: set[int]) -> None:
    """Idle warm actors on `nodes` (one per rank placed there), started now where there are too few
    (a node back from repair under its name, a spare the prewarm has not reached yet) and waited for:
    a replica forms on warm workers or not at all (RuntimeError: the world path takes over)."""
    import collections

    import ray

    need = collections.Counter(nodes)
    short = {node: len(group._pool.get(node, [])) + n - sum(id(a) not in busy for a in group._pool.get(node, []))
             for node, n in need.items() if sum(id(a) not in busy for a in group._pool.get(node, [])) < n}
    warming = [ref for node in need for ref in group._warming.pop(node, [])]
    new = group._grow_pool(short) if short else []
    # (held for the run, not part of any launch's gang)
    group._growth, group._growth_group_of, group._growth_refs = [], {}, {}
    refs = warming + [ref for _, ref in new]
    if refs:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=group.launch_timeout_s)
        if len(ready) < len(refs):
            raise RuntimeError(f"warm workers on {sorted(short)} did not start in {group.launch_timeout_s:.0f} s")
        ray.get(ready)


def reattach(group: "RayWorkerGroup", attempt: "AttemptSpec", incarnation: dict[int, int],
             out: frozenset[int] = frozenset(), rejoined: frozenset[int] = frozenset()) -> bool:
    """A restarted controller takes over a failure_domain replica attempt: its membership goes on from
    the newest epoch in the run's store (which outlived the earlier controller), each replica's
    incarnation from its ranks' (`incarnation`: rank -> the incarnation its process runs, the
    highest seen). The replicas `out` (lost and not rejoined then, being formed again perhaps) are
    out of the membership (an epoch without them, if the newest still lists one joining) and are
    formed anew, with an incarnation past any their ranks ran. A replica the newest epoch lists as
    joining that the timeline saw rejoin (`rejoined`) holds the state (it may give it). False when
    the membership does not match (the world path's resume takes over)."""
    group._replicas = None
    replicas, world = attempt.placement.mesh.dp_replicas, attempt.placement.mesh.world_size
    if attempt.failure_domain != "replica" or replicas < 2:
        return not out
    import torch.distributed as dist

    from trainer.protocol import NotContainable
    from trainer.replica import MembershipBoard

    board = MembershipBoard(dist.PrefixStore(f"{attempt.run_id}/attempt-{attempt.attempt}/", group._store))
    newest = board.newest_epoch()
    if newest < 0:
        return False
    roster = Roster.resume(replicas, board.get(newest), confirmed=rejoined)
    try:
        membership = roster.lose(out)
    except NotContainable:
        return False
    if roster.members != set(range(replicas)) - out:
        return False
    r = ReplicaTracking(board, replicas, world, roster)
    live = [k for k in range(replicas) if k not in out]
    r.incarnation = {k: incarnation.get(k * r.per, 0) for k in live if incarnation.get(k * r.per)}
    if any(incarnation.get(rank, 0) != r.incarnation.get(k, 0) for k in live for rank in r.ranks(k)):
        return False  # (the ranks of a live replica run different incarnations)
    for k in out:  # (past any incarnation an earlier controller started, ready or not)
        r.incarnation[k] = max([incarnation.get(rank, 0) for rank in r.ranks(k)] + [_readied(board, k)])
    if membership is not None:
        board.publish(membership)
    group._replicas = r
    return True


def _readied(board: Any, replica: int) -> int:
    """The newest incarnation of `replica` whose first rank said it was ready (0: none)."""
    n = 0
    while board.store.check([f"ready/{replica}/{n + 1}/0"]):
        n += 1
    return n


def peer_restore(attempt: "AttemptSpec", rank: int, incarnation: int) -> Any:
    """The peer snapshot step this rank loads at its start: none for a replica formed again (it
    receives a live one's state) or one whose nodes do not hold the step (it joins at epoch 0)."""
    if incarnation or attempt.peer_restore is None:
        return None
    if attempt.peer_replicas is not None:
        per = attempt.placement.mesh.world_size // attempt.placement.mesh.dp_replicas
        if rank // per not in attempt.peer_replicas:
            return None
    return attempt.peer_restore


def collective_reach(group: "RayWorkerGroup", ranks: set[int]) -> set[int]:
    """The ranks whose processes `ranks`' collectives reach: every rank of the attempt over a world
    (a failed collective names no peer), their replicas' ranks under failure_domain replica."""
    r = group._replicas
    if not ranks:
        return set()
    if r is None:
        return set(range(len(group._node_of_rank)))
    return {mate for replica in {rank // r.per for rank in ranks} for mate in r.ranks(replica)} - r.out


def forming_ranks(group: "RayWorkerGroup") -> set[int]:
    r = group._replicas
    return {rank for replica in r.roster.forming for rank in r.ranks(replica)} if r is not None else set()


def awaited_ranks(group: "RayWorkerGroup") -> set[int]:
    """The ranks whose end the attempt's end waits for: every one but those of replicas out or still
    forming; and once every rank of the replicas that hold the state has ended, those alone: a replica
    still joining then has no one to take the state from (it was published joining as the holders
    ended the run's last step, and would wait its collective timeout for them)."""
    every = set(range(len(group._runs)))
    r = group._replicas
    if r is None:
        return every
    holders = {rank for replica in r.roster.holders for rank in r.ranks(replica)}
    if holders and holders <= group._finished:
        return holders
    return every - r.out - forming_ranks(group)


def publish_joining(group: "RayWorkerGroup") -> None:
    """Replicas formed again whose every rank has built its world join at the next epoch."""
    r = group._replicas
    if r is None or not r.roster.forming:
        return
    ready = [k for k, inc in r.roster.forming.items()
             if r.board.store.check([f"ready/{k}/{inc}/{local}" for local in range(r.per)])]
    if (membership := r.roster.ready(ready)) is not None:
        r.board.publish(membership)


def on_events(group: "RayWorkerGroup", events: list[tuple[int, str, dict[str, Any]]], *, lost: bool) -> None:
    """What the ranks said that moves the membership: a rejoin (the replica holds the state now: a
    holder in later epochs), and a step discarded or an epoch switch failed with no node `lost` in
    the same poll (a transient collective error, or a replica slower than the timeout): the epoch
    that resolves it (trainer/protocol.Roster.resolve_discard), at once."""
    from controller.events import EventKind

    r = group._replicas
    if r is None:
        return
    for _, kind, detail in events:
        if kind == EventKind.REPLICA_REJOINED:
            r.roster.rejoined(int(k) for k in detail.get("replicas", ()))
    if lost:
        return  # (the loss's own epoch answers the survivors' discards)
    for _, kind, detail in events:
        if kind == EventKind.REPLICA_STEP_DISCARDED and "epoch" in detail:
            if (membership := r.roster.resolve_discard(int(detail["epoch"]))) is not None:
                r.board.publish(membership)
                r.resolved.append({"epoch": membership.epoch, "discarded_at": int(detail["epoch"]),
                                   "step": detail.get("step")})


class ReplicaTracking:
    """An attempt's replicas under failure_domain replica on Ray: who is in (trainer/protocol.Roster,
    whose epochs go to the run's store), each replica's incarnation (its ranks' processes), and the
    epochs published to resolve a discarded step (`resolved`, for the timeline)."""

    def __init__(self, board: Any, replicas: int, world: int, roster: Roster | None = None) -> None:
        self.board = board
        self.per = world // replicas
        self.roster = roster if roster is not None else Roster(replicas, 0, frozenset(range(replicas)))
        self.incarnation: dict[int, int] = {}
        self.resolved: list[dict[str, Any]] = []

    @property
    def out(self) -> set[int]:
        """The ranks of replicas neither members nor forming (lost, waiting for nodes)."""
        return {rank for replica in self.roster.out for rank in self.ranks(replica)}

    @property
    def live(self) -> set[int]:
        return set(self.roster.members)

    def ranks(self, replica: int) -> range:
        return range(replica * self.per, (replica + 1) * self.per)
