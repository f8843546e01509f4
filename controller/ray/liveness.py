"""Whether a node's raylet still listens: the probe that confirms a node lost before Ray's own health
checks declare it dead (controller/ray/worker_group.py asks it of suspect nodes)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

RAYLET_PROBE_S = 0.3
"""How long a probe of a node's raylet waits for its connection."""


def refusing(addresses: dict[str, list[tuple[str, int]]]) -> set[str]:
    """The names every (host, port) of which refuses a TCP connection: nothing listens there. A
    timeout or an unreachable network says nothing (a firewall may drop what a controller outside the
    cluster sends). A name may be listed at several addresses: a node started again while Ray still
    lists its old raylet is not refusing."""
    if not addresses:
        return set()

    def refused(address: tuple[str, int]) -> bool:
        try:
            socket.create_connection(address, timeout=RAYLET_PROBE_S).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    pairs = [(name, address) for name, listed in addresses.items() for address in listed]
    with ThreadPoolExecutor(max_workers=min(16, len(pairs))) as pool:
        answers = list(pool.map(refused, [address for _, address in pairs]))
    return {name for name in addresses if all(no for (n, _), no in zip(pairs, answers) if n == name)}
