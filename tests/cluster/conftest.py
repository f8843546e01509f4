"""One embedded Ray cluster shared by the cluster tier (each start costs ~10-15 s here), and one S3-protocol
server. Each ends right after the last test that uses it, and the tests that use the cluster run first
(`pytest_collection_modifyitems`): an idle 5-node cluster takes ~9 % of 2 cores (raylets, agents, GCS),
which the modules that start their own cluster (`goodput serve`, the lab) would otherwise pay for all
along; the dist tier after this one runs on a quiet machine (the unit tier runs beside both at the
lowest CPU priority: tests/tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import psutil
import pytest

from controller.ray.cluster import LocalRayCluster
from controller.spec import LocalClusterSpec

if TYPE_CHECKING:
    from tests.support.s3 import S3Server


SHARED = ("ray_cluster", "s3_server")
"""The package's shared servers, each ended after its last user."""
_last_user: dict[str, str] = {}
"""Shared fixture -> node id of the last test in this session's order that uses it."""
_end: dict[str, Callable[[], None]] = {}
"""Shared fixture -> what ends it (called once: again at the package's end, it does nothing)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use the shared cluster first (a stable sort: each keeps its place otherwise), so
    that it is up only while they run; then note each shared fixture's last user."""
    cluster = [i for i, item in enumerate(items) if _here(item)]
    if cluster:
        ordered = sorted((items[i] for i in cluster), key=lambda item: "ray_cluster" not in _fixtures(item))
        for i, item in zip(cluster, ordered):
            items[i] = item
    for item in items:
        for name in SHARED:
            if name in _fixtures(item):
                _last_user[name] = item.nodeid


def _here(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().parent == Path(__file__).resolve().parent


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


@pytest.hookimpl(trylast=True)  # after the test's own fixtures have ended
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "ray_cluster" in _fixtures(item) and _shared_cluster and _last_user.get("ray_cluster") != item.nodeid:
        _whole_again(_shared_cluster[0], item)
    for name in SHARED:
        if _last_user.get(name) == item.nodeid and name in _end:
            _end.pop(name)()


_shared_cluster: list[LocalRayCluster] = []
"""The shared cluster while it is up."""


def _whole_again(cluster: LocalRayCluster, item: pytest.Item) -> None:
    """After each test on the shared cluster: every node of it is up again, each as Ray sees it, for
    the next test. A node the test killed and did not start again, or one Ray declared dead that was
    not killed through the cluster (a raylet that missed its health checks for ~1.5 s: FAST_HEALTH_CHECK,
    or one killed behind the cluster's back), is started
    again, and the terminal says which, after which test: one such node left down made every later
    test on the cluster fail to plan (8 GPUs wanted, 6 offered)."""
    import ray

    nodes = cluster._nodes  # noqa: SLF001 - the package owns the fixture cluster
    alive = {(info.get("Labels") or {}).get("node") for info in ray.nodes() if info.get("Alive")}
    dead = sorted(name for name in nodes if name not in alive)
    for name in dead:
        try:
            cluster._cluster.remove_node(nodes.pop(name), allow_graceful=False)  # noqa: SLF001 - (Ray's books)
        except Exception:  # noqa: BLE001 - already gone
            pass
    missing = [f"node-{i}" for i in range(cluster.local.nodes) if f"node-{i}" not in nodes]
    for name in missing:
        cluster.add_node(int(name.removeprefix("node-")))
    if missing:
        said = (f"{', '.join(dead)} dead to Ray, not killed through the cluster" if dead else "")
        left = sorted(set(missing) - set(dead))
        said += ("; " if said and left else "") + (f"{', '.join(left)} killed and not started again" if left else "")
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        capture = item.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():  # (a teardown's output is shown only if it fails)
                reporter.write_line(f"\ntests/cluster: after {item.nodeid}: {said}; started again", yellow=True)


def _once(end: Callable[[], None]) -> Callable[[], None]:
    done: list[bool] = []

    def call() -> None:
        if not done:
            done.append(True)
            end()
    return call


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
    _shared_cluster.append(cluster)

    def end() -> None:
        _shared_cluster.clear()
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

    _end["ray_cluster"] = end = _once(end)
    try:
        yield cluster
    finally:
        end()


@pytest.fixture(scope="package")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["S3Server"]:
    """moto in server mode on 127.0.0.1 behind a fault-injecting proxy; AWS_* env points at it so
    spawned rank processes see it too."""
    from tests.support.s3 import S3Server, restore_env, set_env

    server = S3Server(tmp_path_factory.mktemp("s3"))
    saved = set_env(server.env())

    def end() -> None:
        restore_env(saved)
        server.stop()

    _end["s3_server"] = end = _once(end)
    try:
        yield server
    finally:
        end()


@pytest.fixture
def bucket(s3_server: "S3Server", request: pytest.FixtureRequest) -> Iterator[str]:
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    s3_server.create_bucket(name)
    s3_server.proxy.heal()
    yield name
    s3_server.proxy.heal()
