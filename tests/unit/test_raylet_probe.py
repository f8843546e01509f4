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
