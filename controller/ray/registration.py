"""Starting a node of the embedded cluster without Ray's one-second naps.

A Ray node's start (`ray._private.node.Node`, which `Cluster.add_node` builds) ends by asking the GCS for
the node's own entry, and Ray's C++ side of that question (`GlobalStateAccessor::GetNode`) sleeps a whole
second between two tries. A raylet registers ~0.6 s after it starts on 2 cores (once its dashboard agent
has written its ports), so the first try misses and every node costs ~1.1 s where its registration took
0.6 s: ~3 s of `make run`'s 5-node cluster start. Ray has no setting for that nap
(`raylet_start_wait_time_s` bounds the whole wait, not its step).

While `prompt_registration()` is held, Ray's lookup first waits for the node itself, asking the GCS every
50 ms for the node table (what `ray.nodes()` lists), and only then lets Ray ask, which now finds it at
once. The wait gives up after `WAIT_S` and leaves the rest to Ray's own loop, so a Ray that lists nodes
differently costs a start its old second, never a failure. `seen` counts the nodes the wait saw register
(tests/cluster/test_embedded_cluster.py checks that it sees every one).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

EVERY_S = 0.05
WAIT_S = 10.0

_held = threading.Lock()
"""One patched lookup at a time (the clusters of one process start their nodes one after another)."""
seen = 0
"""How many nodes the wait saw register (since the process started)."""


def _registered(gcs_address: str, node_id: str) -> bool:
    """Wait until the GCS lists `node_id` alive (False: not within WAIT_S, or the table reads otherwise)."""
    import ray._private.services as services
    from ray._private.state import GlobalState

    state = GlobalState()
    state._initialize_global_state(services._get_gcs_client_options(gcs_address))
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if any(n.get("NodeID") == node_id and n.get("Alive") for n in state.node_table()):
                return True
            time.sleep(EVERY_S)
        return False
    finally:
        state.disconnect()


@contextlib.contextmanager
def prompt_registration() -> Iterator[None]:
    """Node starts in here wait for their registration 50 ms at a time, not a second at a time."""
    import ray._private.services as services

    with _held:
        ray_get_node = services.get_node

        def get_node(gcs_address: str, node_id: str, *args: Any, **kwargs: Any) -> Any:
            global seen
            try:
                if _registered(gcs_address, node_id):
                    seen += 1
            except Exception:  # noqa: BLE001 - Ray's own lookup below waits and says what is wrong
                pass
            return ray_get_node(gcs_address, node_id, *args, **kwargs)

        services.get_node = get_node
        try:
            yield
        finally:
            services.get_node = ray_get_node
