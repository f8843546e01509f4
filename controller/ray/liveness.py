"""Whether a node's raylet still listens: the probe that confirms a node lost before Ray's own health
checks declare it dead (controller/ray/worker_group.py asks it of suspect nodes).

Two answers, for two kinds of failure. `refusing`: the connection is refused, so the host answers but
nothing listens (a loud death: the raylet is gone). `unanswered`: nothing answers within the probe's
wait (a silent one: the host is dark, cut off, or its network drops what we send); on its own that
says little (a firewall may drop a controller's probe), so it only corroborates a node whose
heartbeat has stopped (health/heartbeat.py)."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from controller.errors import ClusterSilent

RAYLET_PROBE_S = 0.3
"""How long a probe of a node's raylet waits for its connection."""
NODE_TABLE_WAIT_S = 1.0
"""How long a poll waits for Ray's GCS to list its nodes before it judges nothing this time."""

_table_lock = threading.Lock()
_table_read: Future | None = None
"""The read of Ray's node table in flight (one per process), None when none is."""


def node_table(wait_s: float | None) -> list[dict[str, Any]]:
    """What `ray.nodes()` lists, waited for `wait_s` at most (None: as long as Ray's own client waits,
    which retries for a minute); ClusterSilent when it has not answered by then. A controller cut off
    from the GCS must not stall in its poll: it would learn only after the cut that it was cut off.
    The read runs on a daemon thread of its own and is never doubled: a read still in flight is
    waited on by the next caller, and its answer is theirs when it comes."""
    global _table_read
    import ray

    with _table_lock:
        if _table_read is None:
            read: Future = Future()
            _table_read = read

            def run() -> None:
                global _table_read
                try:
                    table, error = ray.nodes(), None
                except BaseException as e:  # noqa: BLE001 - the caller raises it
                    table, error = None, e
                with _table_lock:  # (done: the next call reads afresh)
                    _table_read = None
                if error is None:
                    read.set_result(table)
                else:
                    read.set_exception(error)

            threading.Thread(target=run, name="goodput-node-table", daemon=True).start()
        read = _table_read
    try:
        return read.result(timeout=wait_s)
    except FutureTimeout:
        raise ClusterSilent(f"Ray's GCS did not list its nodes within {wait_s:.1f} s") from None


def probe(addresses: dict[str, list[tuple[str, int]]]) -> dict[str, set[str]]:
    """What each name's (host, port)s answer a TCP connection within RAYLET_PROBE_S: `accepted`,
    `refused` (the host answers, nothing listens) or `silent` (a timeout, or no route to it)."""
    if not addresses:
        return {}

    def answer(address: tuple[str, int]) -> str:
        try:
            socket.create_connection(address, timeout=RAYLET_PROBE_S).close()
        except ConnectionRefusedError:
            return "refused"
        except OSError:
            return "silent"
        return "accepted"

    pairs = [(name, address) for name, listed in addresses.items() for address in listed]
    with ThreadPoolExecutor(max_workers=min(16, len(pairs))) as pool:
        answers = list(pool.map(answer, [address for _, address in pairs]))
    out: dict[str, set[str]] = {name: set() for name in addresses}
    for (name, _), said in zip(pairs, answers):
        out[name].add(said)
    return out


def refusing(addresses: dict[str, list[tuple[str, int]]]) -> set[str]:
    """The names every (host, port) of which refuses a TCP connection: nothing listens there. A
    timeout or an unreachable network says nothing (a firewall may drop what a controller outside the
    cluster sends). A name may be listed at several addresses: a node started again while Ray still
    lists its old raylet is not refusing."""
    return {name for name, said in probe(addresses).items() if said == {"refused"}}


def unanswered(addresses: dict[str, list[tuple[str, int]]]) -> set[str]:
    """The names none of whose (host, port) accepts or refuses a TCP connection within RAYLET_PROBE_S."""
    return {name for name, said in probe(addresses).items() if said == {"silent"}}


def raylet_addresses(nodes: set[str]) -> dict[str, list[tuple[str, int]]]:
    """Where Ray lists the raylets of `nodes` alive (by their `node` label); ClusterSilent when the GCS
    does not say within NODE_TABLE_WAIT_S."""
    alive: dict[str, list[tuple[str, int]]] = {}
    for info in node_table(NODE_TABLE_WAIT_S):
        name = (info.get("Labels") or {}).get("node")
        if name in nodes and info.get("Alive"):
            alive.setdefault(name, []).append((info["NodeManagerAddress"], int(info["NodeManagerPort"])))
    return alive


def node_states(nodes: set[str], asked: set[str] | None) -> tuple[set[str], set[str]]:
    """(dead, suspect) among `nodes`, as Ray lists them (`ray.nodes()`, by their `node` label). Dead:
    no alive Ray node carries the label. Suspect: Ray still shows the node alive but its raylet
    refuses connections; asked of the nodes in `asked` (None: every node; an empty set: none), and of
    every node once one of them refuses or Ray declared one dead, so that nodes lost together are
    decided on together (two replicas' nodes killed at once are one world-path failure, not one
    replica's). Ray declares a node dead after a few missed health checks (~30 s by default, 1.5 s in
    the embedded cluster), so nodes lost together are declared a moment apart: the probe confirms them
    at once. ClusterSilent when the GCS does not list its nodes within NODE_TABLE_WAIT_S."""
    alive: dict[str, list[tuple[str, int]]] = {}
    seen = set()
    for info in node_table(NODE_TABLE_WAIT_S):
        name = (info.get("Labels") or {}).get("node")
        if name in nodes:
            seen.add(name)
            if info.get("Alive"):  # (a node started again under its name: its old raylet may still be listed)
                alive.setdefault(name, []).append((info["NodeManagerAddress"], int(info["NodeManagerPort"])))
    dead = seen - set(alive)
    if dead or asked is None:
        return dead, refusing(alive)
    first = refusing({name: addresses for name, addresses in alive.items() if name in asked})
    if not first:
        return dead, set()
    return dead, first | refusing({name: addresses for name, addresses in alive.items() if name not in asked})
