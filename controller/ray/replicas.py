"""failure_domain replica on Ray (controller/replicas.py decides, the worker group acts): the membership
of an attempt's replicas, kept as epochs in the run's store. Who is in (trainer/protocol.Roster),
each replica's incarnation (the processes its ranks run), the ranks a poll waits for and asks about,
and the epochs that move without a node lost: a replica formed again joins once every one of its
ranks has built its replica's world (`publish_joining`), a discarded step is resolved (`on_events`).

The worker group (controller/ray/worker_group.py) ends a lost replica's processes and forks new ones
from warm actors; it asks this object which ranks, and tells it what it did. Nothing here touches an
actor."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

from trainer.protocol import Membership, Roster

if TYPE_CHECKING:
    from controller.attempt import AttemptSpec


class ReplicaTracking:
    """An attempt's replicas under failure_domain replica on Ray: who is in (`roster`, whose epochs go
    to the run's store through `board`), each replica's incarnation, and the epochs published to
    resolve a discarded step (`resolved`, for the timeline)."""

    def __init__(self, board: Any, replicas: int, world: int, roster: Roster | None = None) -> None:
        self.board = board
        self.per = world // replicas
        self.roster = roster if roster is not None else Roster(replicas, 0, frozenset(range(replicas)))
        self.incarnation: dict[int, int] = {}
        self.resolved: list[dict[str, Any]] = []

    @classmethod
    def start(cls, store: Any, attempt: "AttemptSpec") -> "ReplicaTracking | None":
        """The membership of a launched attempt, its first epoch published in `store` (the attempt's
        prefix of the run's store); None when the attempt does not run each replica as its own world.
        Replicas whose nodes do not hold the peer snapshot loaded join at epoch 0: a loading one gives
        them its state."""
        mesh = attempt.placement.mesh
        if attempt.failure_domain != "replica" or mesh.dp_replicas < 2:
            return None
        from trainer.membership import MembershipBoard

        receiving = tuple(k for k in range(mesh.dp_replicas)
                          if attempt.peer_restore is not None and attempt.peer_replicas is not None
                          and k not in attempt.peer_replicas)
        roster, first = Roster.start(mesh.dp_replicas, receiving)
        tracking = cls(MembershipBoard(store), mesh.dp_replicas, mesh.world_size, roster)
        tracking.board.publish(first)
        return tracking

    @classmethod
    def resume(cls, store: Any, attempt: "AttemptSpec", incarnation: dict[int, int], out: frozenset[int],
               rejoined: frozenset[int]) -> "ReplicaTracking | None":
        """A restarted controller takes over a failure_domain replica attempt: its membership goes on
        from the newest epoch in `store` (the attempt's prefix of the run's store, which outlived the
        earlier controller), each replica's incarnation from its ranks' (`incarnation`: rank -> the
        incarnation its process runs, the highest seen). The replicas `out` (lost and not rejoined
        then, being formed again perhaps) are out of the membership (an epoch without them, if the
        newest still lists one joining) and are formed anew, with an incarnation past any their ranks
        ran. A replica the newest epoch lists as joining that the timeline saw rejoin (`rejoined`)
        holds the state (it may give it). None when the membership does not match (the world path's
        resume takes over)."""
        from trainer.membership import MembershipBoard
        from trainer.protocol import NotContainable

        mesh = attempt.placement.mesh
        board = MembershipBoard(store)
        newest = board.newest_epoch()
        if newest < 0:
            return None
        roster = Roster.resume(mesh.dp_replicas, board.get(newest), confirmed=rejoined)
        try:
            membership = roster.lose(out)
        except NotContainable:
            return None
        if roster.members != set(range(mesh.dp_replicas)) - out:
            return None
        r = cls(board, mesh.dp_replicas, mesh.world_size, roster)
        live = [k for k in range(mesh.dp_replicas) if k not in out]
        r.incarnation = {k: incarnation.get(k * r.per, 0) for k in live if incarnation.get(k * r.per)}
        if any(incarnation.get(rank, 0) != r.incarnation.get(k, 0) for k in live for rank in r.ranks(k)):
            return None  # (the ranks of a live replica run different incarnations)
        for k in out:  # (past any incarnation an earlier controller started, ready or not)
            r.incarnation[k] = max([incarnation.get(rank, 0) for rank in r.ranks(k)] + [r._readied(k)])
        if membership is not None:
            board.publish(membership)
        return r

    def _readied(self, replica: int) -> int:
        """The newest incarnation of `replica` whose first rank said it was ready (0: none)."""
        n = 0
        while self.board.store.check([f"ready/{replica}/{n + 1}/0"]):
            n += 1
        return n

    @property
    def out(self) -> set[int]:
        """The ranks of replicas neither members nor forming (lost, waiting for nodes)."""
        return {rank for replica in self.roster.out for rank in self.ranks(replica)}

    @property
    def live(self) -> set[int]:
        return set(self.roster.members)

    def ranks(self, replica: int) -> range:
        return range(replica * self.per, (replica + 1) * self.per)

    def forming_ranks(self) -> set[int]:
        """The ranks of replicas being formed again (not members yet: their silence is no loss)."""
        return {rank for replica in self.roster.forming for rank in self.ranks(replica)}

    def running(self, replicas: list[int]) -> list[int]:
        """The ranks of `replicas` that run (not out already)."""
        return [rank for replica in replicas for rank in self.ranks(replica) if rank not in self.out]

    def lose(self, replicas: list[int]) -> Membership | None:
        """These replicas are out: the epoch without them to publish (None for a replica lost while it
        formed: it was no member). NotContainable, with nothing changed, when no replica holding the
        state is left."""
        return self.roster.lose(replicas)

    def publish(self, membership: Membership | None) -> float:
        """Publish `membership` (if any): the survivors go on with it. When (Unix seconds)."""
        if membership is not None:
            self.board.publish(membership)
        return time.time()

    def form(self, replica: int) -> int:
        """`replica` is formed again: the incarnation its new processes run."""
        incarnation = self.incarnation.get(replica, 0) + 1
        self.incarnation[replica] = incarnation
        self.roster.form(replica, incarnation)
        return incarnation

    def collective_reach(self, ranks: set[int]) -> set[int]:
        """The ranks whose processes `ranks`' collectives reach: their replicas' ranks still in."""
        return {mate for replica in {rank // self.per for rank in ranks} for mate in self.ranks(replica)} - self.out

    def awaited(self, every: set[int], finished: set[int]) -> set[int]:
        """Of `every` rank, those whose end the attempt's end waits for: all but those of replicas out
        or still forming; and once every rank of the replicas that hold the state has ended
        (`finished`), those alone: a replica still joining then has no one to take the state from (it
        was published joining as the holders ended the run's last step, and would wait its collective
        timeout for them)."""
        holders = {rank for replica in self.roster.holders for rank in self.ranks(replica)}
        if holders and holders <= finished:
            return holders
        return every - self.out - self.forming_ranks()

    def publish_joining(self) -> None:
        """Replicas formed again whose every rank has built its world join at the next epoch."""
        if not self.roster.forming:
            return
        ready = [k for k, inc in self.roster.forming.items()
                 if self.board.store.check([f"ready/{k}/{inc}/{local}" for local in range(self.per)])]
        if (membership := self.roster.ready(ready)) is not None:
            self.board.publish(membership)

    def on_events(self, events: Iterable[tuple[int, str, dict[str, Any]]], *, lost: bool) -> None:
        """What the ranks said that moves the membership: a rejoin (the replica holds the state now: a
        holder in later epochs), and a step discarded or an epoch switch failed with no node `lost` in
        the same poll (a transient collective error, or a replica slower than the timeout): the epoch
        that resolves it (trainer/protocol.Roster.resolve_discard), at once."""
        from controller.events import EventKind

        events = list(events)
        for _, kind, detail in events:
            if kind == EventKind.REPLICA_REJOINED:
                self.roster.rejoined(int(k) for k in detail.get("replicas", ()))
        if lost:
            return  # (the loss's own epoch answers the survivors' discards)
        for _, kind, detail in events:
            if kind == EventKind.REPLICA_STEP_DISCARDED and "epoch" in detail:
                if (membership := self.roster.resolve_discard(int(detail["epoch"]))) is not None:
                    self.board.publish(membership)
                    self.resolved.append({"epoch": membership.epoch, "discarded_at": int(detail["epoch"]),
                                          "step": detail.get("step")})


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
