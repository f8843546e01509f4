"""An existing cluster, as production has it: a Ray head and labelled worker raylets started with
`ray start` on 127.0.0.1 (their own temp dir), `goodput serve --address` joining it. A submitted run
survives a kill-node drill there (onto the spare); then the service is SIGKILLed while the run trains:
its workers outlive it on the cluster, and the service started again re-attaches to them (same
attempt, no step redone) and the run succeeds. A run whose replicas are its failure domains keeps
training through both: a node of one replica killed heals that replica from the other, the service
SIGKILLed and started again re-attaches to the same attempt (its membership and rendezvous store
outlived the service: controller/ray/run_store.py), and a node killed after that is contained again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.cluster.test_service import Serve, wait_for, write_spec
from tests.support.ray_start import LOOPBACK_ENV, RayStartCluster

pytestmark = pytest.mark.cluster

# Each run must outlast what the test does to it, and no more: the steps after that are time the suite
# spends and nothing it checks. Measured here (one run of the module, from the registries' events):
# - ext: re-attached at ~step 140 (kill-node at 20, 20 more, SIGKILL, 3 s, a restart), 400 ended at +60 s;
# - rep: the second replica rejoined at step 74, 300 ended at +55 s;
# - mid: the replica rejoined at step 130 (the node back by `ray start`), 600 ended at +117 s.
# Each keeps over 100 steps past that (more than 25 s here; a slower machine slows both alike).
STEPS_EXT, STEPS_REP, STEPS_MID = 260, 180, 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayStartCluster]:
    """One cluster for the module's services, one after the other (~30 s of `ray start` each):
    4 labelled nodes and 3 spares, one spare for the first test's kill-node and two for the replica
    test's; a node killed stays dead, as on a real cluster, and the next service finds it so."""
    c = RayStartCluster(tmp_path_factory.mktemp("ray-start"))
    try:
        yield c.start(nodes=7, spares=3)
    finally:
        c.stop()


@pytest.fixture
def loopback_env() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)  # the service (a subprocess) joins as a driver on 127.0.0.1
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_serve_on_an_existing_cluster_survives_kill_node_and_its_own_death(
        cluster: RayStartCluster, loopback_env: None, tmp_path: Path) -> None:
    serve = Serve(tmp_path / "state", tmp_path / "serve.log", "--address", cluster.address)
    try:
        serve.start()
        serve.cli("submit", str(write_spec(tmp_path / "ext.yaml", "ext", steps=STEPS_EXT, dp=2)))
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
        assert run["step"] == STEPS_EXT
    finally:
        serve.stop()


def test_replica_run_heals_and_is_reattached_after_the_service_dies(cluster: RayStartCluster, loopback_env: None,
                                                                   tmp_path: Path) -> None:
    path = write_spec(tmp_path / "rep.yaml", "rep", steps=STEPS_REP, dp=4)
    spec = yaml.safe_load(path.read_text())
    spec["parallelism"]["dp_replicas"] = 2  # two replicas of 2 ranks, each on a node of its own
    spec["elastic"] = {"failure_domain": "replica"}
    path.write_text(yaml.safe_dump(spec))
    serve = Serve(tmp_path / "state", tmp_path / "serve.log", "--address", cluster.address)
    try:
        serve.start()
        serve.cli("submit", str(path))
        wait_for(serve, "rep", lambda s: s["step"] >= 12)
        first = serve.json("drill", "rep", "kill-node")
        assert isinstance(first, dict) and first["decision"] == "heal_replica", first
        wait_for(serve, "rep", lambda s: _rejoined(serve) == 1)
        assert serve.proc is not None
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.wait()
        time.sleep(3)  # the replicas train on without their controller, under the membership it left
        serve.start()
        status = wait_for(serve, "rep", lambda s: s["state"] == "running")
        at = status["step"]
        second = serve.json("drill", "rep", "kill-node")  # after the re-attach: contained again
        assert isinstance(second, dict) and second["decision"] == "heal_replica", second
        assert second["target"] != first["target"]
        run = wait_for(serve, "rep", lambda s: s["state"] == "succeeded")
        events = serve.json("events", "rep")
        assert isinstance(events, list)
        timeline = [(e["kind"], e["detail"]) for e in events
                    if e["kind"] in ("service_restarted", "replica_lost", "replica_rejoined", "attempt_started")]
        restarted = [e for e in events if e["kind"] == "service_restarted"]
        assert len(restarted) == 1 and "re-attached" in restarted[0]["detail"]["action"], timeline
        assert run["attempt"] == 0 and [e["attempt"] for e in events if e["kind"] == "attempt_started"] == [0], \
            f"one attempt all along: {timeline}"
        assert _rejoined(serve) == 2, timeline
        assert second["at_step"] >= at, second
        assert run["step"] == STEPS_REP
        agreed = [e for e in events if e["kind"] == "replica_checksums"]
        assert agreed and all(e["detail"]["agree"] for e in agreed), agreed[-3:]
    finally:
        serve.stop()


def test_a_service_killed_in_the_middle_of_a_heal_reattaches_and_forms_the_replica(
        cluster: RayStartCluster, loopback_env: None, tmp_path: Path) -> None:
    """Issue 44, item 5: a service restarted between `replica_lost` and `replica_rejoined` refused to
    re-attach and closed the group: the run resumed from the store as a new attempt. Here, by
    construction: every node of the cluster but two lost first (killed by PID, as a power loss
    would), two replicas on those two, a node of replica 1 killed by a drill, and with no node to form it
    on, the replica stays out while replica 0 trains on. The service is SIGKILLed then, started
    again: it re-attaches to the same attempt with the replica out; the node comes back from repair
    (a raylet under its name joins), the replica is formed there again, receives replica 0's state and rejoins;
    the run succeeds in attempt 0 with nothing restored from the store."""
    path = write_spec(tmp_path / "mid.yaml", "mid", steps=STEPS_MID, dp=4)
    spec = yaml.safe_load(path.read_text())
    spec["parallelism"]["dp_replicas"] = 2
    spec["elastic"] = {"failure_domain": "replica"}
    path.write_text(yaml.safe_dump(spec))
    alive = cluster.node_labels()
    keep = sorted(n for n, (labels, _) in alive.items() if labels.get("spare") != "true")[:2]
    assert len(keep) == 2, alive
    for node in set(alive) - set(keep):
        cluster.kill_node(node)  # (nothing left but the run's two nodes: no node to form a replica on)
    time.sleep(5)  # (Ray declares them dead within ~2 s here: FAST_HEALTH_CHECK)
    serve = Serve(tmp_path / "state", tmp_path / "serve.log", "--address", cluster.address)
    try:
        serve.start()
        serve.cli("submit", str(path))
        wait_for(serve, "mid", lambda s: s["step"] >= 10)
        drill = serve.json("drill", "mid", "kill-node", "--target", "replica:1")
        assert isinstance(drill, dict) and drill["decision"] == "heal_replica", drill
        assert serve.proc is not None
        serve.proc.send_signal(signal.SIGKILL)  # the replica is out, waiting for a node: mid-heal
        serve.proc.wait()
        serve.start()
        wait_for(serve, "mid", lambda s: s["state"] == "running")
        events = serve.json("events", "mid")
        assert isinstance(events, list)
        restarted = [e for e in events if e["kind"] == "service_restarted"]
        assert len(restarted) == 1 and "re-attached" in restarted[0]["detail"]["action"], restarted
        assert "formed again" in restarted[0]["detail"]["action"]
        cluster.ray_start("--address", cluster.address, "--num-cpus", "2", "--num-gpus", "2",
                          "--labels", f"node={drill['target']},rack=rack-0")  # the node back from repair
        run = wait_for(serve, "mid", lambda s: s["state"] == "succeeded", timeout_s=600)
        events = serve.json("events", "mid")
        assert isinstance(events, list)
        kinds = [e["kind"] for e in events]
        assert run["attempt"] == 0 and kinds.count("attempt_started") == 1, kinds
        rejoined = [e["detail"] for e in events if e["kind"] == "replica_rejoined"]
        assert [d["replicas"] for d in rejoined] == [[1]], rejoined
        assert kinds.index("service_restarted") < kinds.index("replica_rejoined")
        assert not any(e["kind"] == "restored" and e["detail"].get("source") == "store" for e in events)
        agreed = [e for e in events if e["kind"] == "replica_checksums"]
        assert agreed and all(e["detail"]["agree"] for e in agreed), agreed[-3:]
    finally:
        serve.stop()


def _rejoined(serve: Serve) -> int:
    events = serve.json("events", "rep")
    assert isinstance(events, list)
    return sum(e["kind"] == "replica_rejoined" for e in events)
