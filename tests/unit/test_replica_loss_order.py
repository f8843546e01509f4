"""The survivors of a lost replica are told before anything of the lost one is waited for (issue 44,
item 9): `lose_replicas` publishes the epoch without it first; stopping the lost replica's training
processes on live nodes (up to 15 s) comes after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from controller.ray.replicas import ReplicaTracking
from controller.ray.worker_group import RayWorkerGroup


class Board:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def publish(self, membership: object) -> None:
        self.calls.append("publish")


def test_the_epoch_without_the_lost_replica_is_published_before_its_stops_are_waited_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    calls: list[str] = []
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: calls.append(f"wait {len(refs)} stop(s)") or (refs, []))
    stopping = SimpleNamespace(stop=SimpleNamespace(remote=lambda: "stop-ref"))
    tracking = ReplicaTracking(Board(calls), replicas=2, world=4)
    group = RayWorkerGroup()
    group._replicas, group._attempt = tracking, SimpleNamespace(peer_every=0)  # type: ignore[assignment]
    group._node_of_rank, group.actors = ("a", "b", "c", "d"), [stopping] * 4
    monkeypatch.setattr(group, "on_gone_nodes", lambda ranks: {3})
    told = group.lose_replicas([1], ("d",))
    assert calls == ["publish", "wait 1 stop(s)"], "told first; the live node's rank of replica 1 stopped after"
    assert told > 0 and tracking.live == {0} and tracking.out == {2, 3}


def test_a_discard_with_nothing_lost_in_the_poll_publishes_one_resync_epoch() -> None:
    """Issue 44, item 1, the worker group's side (ReplicaTracking.on_events): a discarded step
    with no node, rank or error in the same poll gets the resync epoch at once (and joins the
    timeline); the other replicas' reports of the same discard publish nothing more; a discard that
    comes with a loss is answered by the loss's own epoch; a rejoin makes the replica a holder."""
    from controller.events import EventKind
    from trainer.protocol import Membership, Roster

    published: list[Membership] = []
    board = SimpleNamespace(publish=published.append)
    roster, _ = Roster.start(3)
    tracking = ReplicaTracking(board, replicas=3, world=6, roster=roster)
    discard = (0, EventKind.REPLICA_STEP_DISCARDED, {"epoch": 0, "step": 7})
    tracking.on_events([discard], lost=True)
    assert published == [], "a loss in the same poll: its own epoch answers the discard"
    tracking.on_events([discard, (2, EventKind.REPLICA_STEP_DISCARDED, {"epoch": 0, "step": 7})], lost=False)
    assert [(m.epoch, m.replicas, m.resync) for m in published] == [(1, (0, 1, 2), True)]
    assert tracking.resolved == [{"epoch": 1, "discarded_at": 0, "step": 7}]
    tracking.on_events([discard], lost=False)
    assert len(published) == 1, "an epoch already answers it"
    roster.lose([2]), roster.form(2, 1), roster.ready([2])
    tracking.on_events([(4, EventKind.REPLICA_REJOINED, {"replicas": [2]})], lost=False)
    assert roster.holders == {0, 1, 2}


def test_a_restarted_service_finds_the_replicas_a_heal_left_out() -> None:
    """Issue 44, item 5: the replicas an attempt's timeline shows lost and not rejoined since (a service
    ended in the middle of a heal), with the nodes they lost: those the re-attached controller forms again."""
    from controller.service.restore import replicas_out

    def e(kind: str, **detail: object) -> dict:
        return {"kind": kind, "detail": detail}

    timeline = [e("attempt_started"), e("replica_lost", replicas=[1], nodes=["n3"]),
                e("replica_rejoined", replicas=[1]), e("replica_lost", replicas=[0, 2], nodes=["n1", "n5"])]
    assert replicas_out(timeline) == {0: ("n1", "n5"), 2: ("n1", "n5")}
    assert replicas_out(timeline[:3]) == {}


def test_a_restarted_controller_knows_a_rejoined_replica_holds_the_state() -> None:
    """The newest epoch of a healed attempt still lists the healed replica as joining (no epoch follows
    a rejoin): a restarted controller that believed it would refuse to contain a later loss of the
    other replica (no holder left) and stop the world. The timeline's rejoin says it holds the state."""
    import torch.distributed as dist

    from trainer.membership import MembershipBoard
    from trainer.protocol import Membership, NotContainable

    store = dist.HashStore()
    prefixed = dist.PrefixStore("run/attempt-0/", store)
    board = MembershipBoard(prefixed)
    for m in (Membership(0, (0, 1)), Membership(1, (0,)), Membership(2, (0, 1), joining=(1,))):
        board.publish(m)
    attempt = SimpleNamespace(failure_domain="replica", run_id="run", attempt=0,
                              placement=SimpleNamespace(mesh=SimpleNamespace(dp_replicas=2, world_size=4)))
    incarnation = {0: 0, 1: 0, 2: 1, 3: 1}
    resumed = ReplicaTracking.resume(prefixed, attempt, incarnation, frozenset(), rejoined=frozenset({1}))  # type: ignore[arg-type]
    assert resumed is not None
    assert resumed.roster.holders == {0, 1} and resumed.incarnation == {1: 1}
    assert resumed.roster.lose([0]) is not None, "replica 1 holds the state: the loss is contained"
    resumed = ReplicaTracking.resume(prefixed, attempt, incarnation, frozenset(), rejoined=frozenset())  # type: ignore[arg-type]
    assert resumed is not None
    with pytest.raises(NotContainable):
        resumed.roster.lose([0])


def test_a_replica_published_joining_as_the_holders_end_the_run_is_not_waited_for() -> None:
    """(Found on a loaded machine by test_replica_domain's donor test: replica 0 was formed again and
    published joining at the poll in which the holders ended step 16 of 16; its ranks waited 20 s
    for a group of members that had exited, the controller took it for a hang and restarted the
    run.) The attempt ends when the replicas that hold the state have ended: a forming or joining
    replica's ranks are not waited for then; before that, a joining replica's are."""
    from trainer.protocol import Roster

    roster, _ = Roster.start(3)
    tracking = ReplicaTracking(SimpleNamespace(), replicas=3, world=6, roster=roster)
    every = set(range(6))
    assert tracking.awaited(every, finished=set()) == every
    roster.lose([0])
    roster.form(0, 1)
    assert tracking.awaited(every, finished=set()) == {2, 3, 4, 5}, "forming: not waited for"
    roster.ready([0])
    assert roster.joining == {0}
    assert tracking.awaited(every, finished=set()) == every, "joining while the holders train"
    assert tracking.awaited(every, finished={2, 3, 4}) == every
    assert tracking.awaited(every, finished={2, 3, 4, 5}) == {2, 3, 4, 5}, "the holders ended: nothing to join"
    roster.rejoined([0])
    assert tracking.awaited(every, finished={2, 3, 4, 5}) == every, "a holder now: its end is waited for"
