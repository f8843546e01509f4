"""An existing cluster, as production has it: a Ray head and labelled worker raylets started with
`ray start` on 127.0.0.1 (their own temp dir), `goodput serve --address` joining it. A submitted run
survives a kill-node drill there (onto the spare); then the service is SIGKILLed while the run trains:
its workers outlive it on the cluster, and the service started again re-attaches to them (same
attempt, no step redone) and the run succeeds."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.cluster.test_service import Serve, wait_for, write_spec
from tests.support.ray_start import LOOPBACK_ENV, RayStartCluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayStartCluster]:
    c = RayStartCluster(tmp_path_factory.mktemp("ray-start"))
    try:
        yield c.start(nodes=3, spares=1)
    finally:
        c.stop()


def test_serve_on_an_existing_cluster_survives_kill_node_and_its_own_death(cluster: RayStartCluster,
                                                                           tmp_path: Path) -> None:
    old = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)  # the service (a subprocess) joins as a driver on 127.0.0.1
    serve = Serve(tmp_path / "state", tmp_path / "serve.log", "--address", cluster.address)
    try:
        serve.start()
        serve.cli("submit", str(write_spec(tmp_path / "ext.yaml", "ext", steps=400, dp=2)))
        wait_for(serve, "ext", lambda s: s["step"] >= 12)
        report = serve.json("drill", "ext", "kill-node")
        assert isinstance(report, dict)
        assert report["outcome"] == "recovered" and report["decision"] == "replace", report
        wait_for(serve, "ext", lambda s: s["attempt"] == 1 and s["step"] >= report["at_step"] + 20)
        assert serve.proc is not None
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.wait()
        time.sleep(3)  # the workers train on without their controller
        serve.start()
        run = wait_for(serve, "ext", lambda s: s["state"] == "succeeded")
        events = serve.json("events", "ext")
        assert isinstance(events, list)
        restarted = [e for e in events if e["kind"] == "service_restarted"]
        assert len(restarted) == 1 and "re-attached" in restarted[0]["detail"]["action"], restarted
        assert run["attempt"] == 1, "the same attempt went on: no new launch"
        assert [e["attempt"] for e in events if e["kind"] == "attempt_started"] == [0, 1]
        assert run["step"] == 400
    finally:
        serve.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
