"""Embedded clusters one after another in one process (as the test session, or anything else that
drives more than one): each keeps to its own folder, nothing of one comes back after its shutdown, and
each node's start waits for its registration 50 ms at a time (controller/ray/registration.py), not a
second at a time, leaving Ray's lookup as it found it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]

TWO_CLUSTERS = textwrap.dedent("""
    import json, os
    from controller.ray import registration
    from controller.ray.cluster import LocalRayCluster
    from controller.spec import LocalClusterSpec

    folders, seen = [], []
    for _ in range(2):
        cluster = LocalRayCluster(LocalClusterSpec(nodes=2, gpus_per_node=1, racks=1, spares=0))
        cluster.start()
        seen.append(registration.seen)
        folders.append({"folder": cluster.folders()[0],
                        "earlier_there": [f["folder"] for f in folders if os.path.exists(f["folder"])]})
        cluster.shutdown()
    import ray._private.services as services
    print(json.dumps({"clusters": folders, "left": [f["folder"] for f in folders if os.path.exists(f["folder"])],
                      "seen": seen, "lookup_restored": services.get_node.__module__ == services.__name__}))
""")


@pytest.fixture(scope="module")
def two_clusters() -> dict:
    proc = subprocess.run([sys.executable, "-c", TWO_CLUSTERS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_cluster_leaves_the_first_ones_folder_removed(two_clusters: dict) -> None:
    """Ray adds the session's object-spilling folder to the system config it is given. Given goodput's
    constant, the second cluster spilled into the first's session folder, which came back, empty or
    with the second's spilled objects, and stayed: every `make test` left one or two."""
    out = two_clusters
    first, second = out["clusters"]
    assert first["folder"] != second["folder"]
    assert second["earlier_there"] == [], "the first cluster's folder came back when the second started"
    assert out["left"] == []


def test_every_node_start_waits_for_its_own_registration_and_ray_is_left_as_it_was(two_clusters: dict) -> None:
    """Each cluster's head and 2 nodes were seen registering by goodput's 50 ms wait (had Ray's node table
    read otherwise, the wait would have given up and each start would have taken Ray's whole second),
    and Ray's lookup is its own again once the nodes are up."""
    assert two_clusters["seen"] == [3, 6]
    assert two_clusters["lookup_restored"]
