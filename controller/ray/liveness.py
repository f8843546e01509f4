"""Whether a node's raylet still listens: the probe that confirms a node lost before Ray's own health
checks declare it dead (controller/ray/worker_group.py asks it of suspect nodes)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

RAYLET_PROBE_S = 0.3
"""How long a probe of a node's raylet waits for its connection."""


def refusing(addresses: dict[str, tuple[str, int]]) -> set[str]:
    """The names whose (host, port) refuses a TCP connection: nothing listens there. A timeout or an
    unreachable network says nothing (a firewall may drop what a controller outside the cluster sends)."""
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

    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        answers = dict(zip(addresses, pool.map(refused, addresses.values())))
    return {name for name, no in answers.items() if no}
