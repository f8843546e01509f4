"""`ray start --address ...` for one more raylet on this machine, on 127.0.0.1 (tests only).

Ray's CLI either refuses a second raylet on a one-machine cluster or rewrites 127.0.0.1 to the
machine's outward address; the tests must stay on loopback. This runs the very same CLI command with
that rewriting turned off, so the raylet it starts is what `ray start` would start on another host.
"""

from __future__ import annotations

import sys

import ray._private.ray_constants as ray_constants
import ray._private.services as services
from ray.scripts.scripts import start

ray_constants.ENABLE_RAY_CLUSTER = True
services.resolve_ip_for_localhost = lambda host: host  # type: ignore[assignment]
services.get_node_ip_address = lambda address=None: "127.0.0.1"  # type: ignore[assignment]

if __name__ == "__main__":
    start.main(sys.argv[1:], prog_name="ray start")
