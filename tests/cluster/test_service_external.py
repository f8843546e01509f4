"""An existing cluster, as production has it: a Ray head and labelled worker raylets started with
`ray start` on 127.0.0.1 (their own temp dir), `goodput serve --address` joining it. A submitted run
survives a kill-node drill there (onto the spare); then the service is SIGKILLed while the run trains:
its workers outlive it on the cluster, and the service started again re-attaches to them (same
attempt, no step redone) and the run succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from controller.ray.cluster import FAST_HEALTH_CHECK
from tests.cluster.test_service import Serve, wait_for, write_spec

pytestmark = pytest.mark.cluster

RAY = str(Path(sys.executable).parent / "ray")
ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray resolves 127.0.0.1 to the machine's address unless told it is a single-machine cluster."""


class RayStartCluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = {**os.environ, **LOOPBACK_ENV}
        self.address = ""

    def ray_start(self, *args: str, head: bool = False) -> None:
        # `ray start` itself for the head; for worker raylets the same command with Ray's rewriting of
        # 127.0.0.1 to the machine's outward address turned off (tests/support/ray_worker_node.py).
        command = [RAY, "start", "--node-ip-address", "127.0.0.1"] if head else [
            sys.executable, str(ROOT / "tests" / "support" / "ray_worker_node.py")]
        proc = subprocess.run([*command, "--temp-dir", str(self.tmp), "--disable-usage-stats", *args],
                              capture_output=True, text=True, env=self.env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    def start(self, nodes: int, spares: int) -> "RayStartCluster":
        self.ray_start("--head", "--port", "0", "--num-cpus", "1", "--num-gpus", "0", "--include-dashboard", "false",
                       "--system-config", json.dumps(FAST_HEALTH_CHECK), head=True)
        self.address = (self.tmp / "ray_current_cluster").read_text().strip()
        assert self.address.startswith("127.0.0.1:"), self.address
        for i in range(nodes):
            labels = f"node=ext-{i},rack=rack-0" + (",spare=true" if i >= nodes - spares else "")
            self.ray_start("--address", self.address, "--num-cpus", "2", "--num-gpus", "2", "--labels", labels)
        return self

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster (their command lines name its temp dir) and their children."""
        ours = []
        for p in psutil.process_iter(["cmdline"]):
            if str(self.tmp) in " ".join(p.info["cmdline"] or []):
                ours.append(p)
                ours.extend(p.children(recursive=True))
        return ours

    def stop(self) -> None:
        """By PID: `ray stop` would end every Ray process on the machine, not just ours."""
        procs = self.processes()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)


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
