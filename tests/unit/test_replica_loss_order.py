"""The survivors of a lost replica are told before anything of the lost one is waited for (issue 44,
item 9): `lose_replicas` publishes the epoch without it first; stopping the lost replica's training
processes on live nodes (up to 15 s) comes after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from controller.ray import replicas as ray_replicas


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
    tracking = ray_replicas.ReplicaTracking(Board(calls), replicas=2, world=4)
    group = SimpleNamespace(_replicas=tracking, _attempt=SimpleNamespace(peer_every=0), _gone=set(),
                            _node_of_rank=("a", "b", "c", "d"), on_gone_nodes=lambda ranks: {3},
                            actors=[stopping] * 4, _failed=set(), _nodes=set(), _drains={}, _peer_key=None)
    told = ray_replicas.lose_replicas(group, [1], ("d",))  # type: ignore[arg-type]
    assert calls == ["publish", "wait 1 stop(s)"], "told first; the live node's rank of replica 1 stopped after"
    assert told > 0 and tracking.live == {0} and tracking.out == {2, 3}
