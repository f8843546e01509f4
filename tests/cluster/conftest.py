"""One embedded Ray cluster shared by the cluster tier (each start costs ~10-15 s here), and one S3-protocol
server; both end with the tier (package scope), so the dist and unit tiers after it run on a quiet machine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import psutil
import pytest

from controller.ray.cluster import LocalRayCluster
from controller.spec import LocalClusterSpec

if TYPE_CHECKING:
    from tests.support.s3 import S3Server


def _ray_children() -> list[psutil.Process]:
    names = ("raylet", "gcs_server", "ray::")
    return [p for p in psutil.Process().children(recursive=True)
            if any(n in " ".join(p.cmdline() or [p.name()]) for n in names) and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[LocalRayCluster]:
    # A user's model and data code is installed in the image of every node (README, "Your model, your
    # data"); here it is this checkout's (examples/, tests/support/), which the nodes' processes find
    # on PYTHONPATH, inherited from here.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] + ([saved] if saved else []))
    cluster = LocalRayCluster(LocalClusterSpec(nodes=5, gpus_per_node=2, racks=2, spares=0))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    left = [p for p in _ray_children() if p.is_running()]
    for p in left:
        try:
            p.wait(10)
        except psutil.TimeoutExpired:
            pass
    still = [p.pid for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not still, f"processes left behind by the cluster: {still}"


@pytest.fixture(scope="package")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["S3Server"]:
    """moto in server mode on 127.0.0.1 behind a fault-injecting proxy; AWS_* env points at it so
    spawned rank processes see it too."""
    from tests.support.s3 import S3Server, restore_env, set_env

    server = S3Server(tmp_path_factory.mktemp("s3"))
    saved = set_env(server.env())
    try:
        yield server
    finally:
        restore_env(saved)
        server.stop()


@pytest.fixture
def bucket(s3_server: "S3Server", request: pytest.FixtureRequest) -> Iterator[str]:
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    s3_server.create_bucket(name)
    s3_server.proxy.heal()
    yield name
    s3_server.proxy.heal()
