"""One embedded Ray cluster shared by the cluster tier (each start costs ~10-15 s here)."""

from __future__ import annotations

from typing import Iterator

import psutil
import pytest

from controller.ray_cluster import LocalRayCluster
from controller.spec import LocalClusterSpec


def _ray_children() -> list[psutil.Process]:
    names = ("raylet", "gcs_server", "ray::")
    return [p for p in psutil.Process().children(recursive=True)
            if any(n in " ".join(p.cmdline() or [p.name()]) for n in names) and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster(LocalClusterSpec(nodes=4, gpus_per_node=2, racks=2, spares=0))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.shutdown()
    left = [p for p in _ray_children() if p.is_running()]
    for p in left:
        try:
            p.wait(10)
        except psutil.TimeoutExpired:
            pass
    still = [p.pid for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not still, f"processes left behind by the cluster: {still}"
