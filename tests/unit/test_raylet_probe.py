"""A node whose raylet refuses connections is suspect at once; one that listens is not."""

from __future__ import annotations

import socket

from controller.ray.liveness import refusing


def test_only_a_refused_connection_makes_a_node_suspect() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: the kernel refuses connections to it
        addresses = {"alive": [listening.getsockname()], "killed": [closed.getsockname()]}
        assert refusing(addresses) == {"killed"}
        # a node started again under its name while Ray still lists its old raylet: the new one answers
        assert refusing({"restarted": [closed.getsockname(), listening.getsockname()]}) == set()
    assert refusing({}) == set()


def test_node_states_asks_the_reach_first_and_every_node_once_one_refuses(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Which raylets are probed, with real sockets behind Ray's node list: the asked nodes first (each
    once); the others only once an asked one refuses (nodes lost together are one decision); every
    node when Ray declared one dead."""
    import ray

    from controller.ray import liveness

    asked_of: list[set[str]] = []
    real = liveness.refusing

    def recorded(addresses):  # type: ignore[no-untyped-def]
        asked_of.append(set(addresses))
        return real(addresses)

    monkeypatch.setattr(liveness, "refusing", recorded)
    with socket.socket() as a, socket.socket() as b, socket.socket() as gone, socket.socket() as other_gone:
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
            s.listen()
        gone.bind(("127.0.0.1", 0))
        other_gone.bind(("127.0.0.1", 0))

        def listed(*entries: tuple[str, socket.socket, bool]) -> list[dict]:
            return [{"Labels": {"node": name}, "Alive": alive, "NodeManagerAddress": s.getsockname()[0],
                     "NodeManagerPort": s.getsockname()[1]} for name, s, alive in entries]

        nodes = {"n0", "n1", "n2", "n3"}
        monkeypatch.setattr(ray, "nodes", lambda: listed(("n0", a, True), ("n1", b, True), ("n2", gone, True),
                                                         ("n3", other_gone, True)))
        assert liveness.node_states(nodes, {"n0", "n1"}) == (set(), set())
        assert asked_of == [{"n0", "n1"}], "a reach that answers: nobody else is asked"
        asked_of.clear()
        assert liveness.node_states(nodes, {"n1", "n2"}) == (set(), {"n2", "n3"})
        assert asked_of == [{"n1", "n2"}, {"n0", "n3"}], "one refused: the others are asked, each node once"
        asked_of.clear()
        assert liveness.node_states(nodes, set()) == (set(), set()) and asked_of == [set()]
        asked_of.clear()
        monkeypatch.setattr(ray, "nodes", lambda: listed(("n0", a, True), ("n1", b, False), ("n2", gone, True)))
        assert liveness.node_states(nodes, {"n0"}) == ({"n1"}, {"n2"})
        assert asked_of == [{"n0", "n2"}], "a node Ray declared dead: every alive node is asked"


def test_the_node_table_is_read_once_at_a_time_and_waited_for_no_longer_than_asked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A GCS that does not answer (a controller cut off from it): the poll's read gives up after its
    wait with ClusterSilent; the next caller waits on the same read rather than start another; its
    answer, when it comes, is theirs; then each call reads afresh."""
    import threading
    import time

    import pytest
    import ray

    from controller.errors import ClusterSilent
    from controller.ray import liveness

    answer = threading.Event()
    reads: list[float] = []

    def nodes() -> list[dict]:
        reads.append(time.monotonic())
        answer.wait(10)
        return [{"Labels": {"node": f"n{len(reads)}"}, "Alive": True}]

    monkeypatch.setattr(ray, "nodes", nodes)
    start = time.monotonic()
    with pytest.raises(ClusterSilent, match="within 0.2 s"):
        liveness.node_table(0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
    with pytest.raises(ClusterSilent):
        liveness.node_table(0.1)
    assert len(reads) == 1, "a read in flight is not doubled"
    answer.set()
    assert liveness.node_table(5.0)[0]["Labels"]["node"] == "n1", "the read in flight answers the next caller"
    assert liveness.node_table(5.0)[0]["Labels"]["node"] == "n2" and len(reads) == 2, "then a fresh read"
