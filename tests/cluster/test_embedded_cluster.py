"""Embedded clusters one after another in one process (as the test session, or anything else that
drives more than one): each keeps to its own folder, and nothing of one comes back after its shutdown."""

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
    from controller.ray.cluster import LocalRayCluster
    from controller.spec import LocalClusterSpec

    folders = []
    for _ in range(2):
        cluster = LocalRayCluster(LocalClusterSpec(nodes=1, gpus_per_node=1, racks=1, spares=0))
        cluster.start()
        folders.append({"folder": cluster.folders()[0],
                        "earlier_there": [f["folder"] for f in folders if os.path.exists(f["folder"])]})
        cluster.shutdown()
    print(json.dumps({"clusters": folders, "left": [f["folder"] for f in folders if os.path.exists(f["folder"])]}))
""")


def test_a_second_cluster_leaves_the_first_ones_folder_removed() -> None:
    """Ray adds the session's object-spilling folder to the system config it is given. Given goodput's
    constant, the second cluster spilled into the first's session folder, which came back, empty or
    with the second's spilled objects, and stayed: every `make test` left one or two."""
    proc = subprocess.run([sys.executable, "-c", TWO_CLUSTERS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = out["clusters"]
    assert first["folder"] != second["folder"]
    assert second["earlier_there"] == [], "the first cluster's folder came back when the second started"
    assert out["left"] == []
