"""Silent faults, in the lab (tests/support/lab.py): each node a host of its own (a network namespace on
a bridge, 198.18.0.0/15, its own hostname and hosts file), a stock `ray start` cluster with Ray's
default health checks (a dead node declared after ~30 s), and `goodput serve --address` outside the
nodes, as an operator deploys it. The drills are goodput's own (controller/ray/netfaults.py), sent
through the CLI; nothing the dark node sent after the cut arrives, and nothing closes.

- power-off on the world path: the node is lost from its heartbeat (not the hang verdict: 30 s here),
  replaced by the spare, and the run goes on from its peer snapshots; a lossy link (5 % dropped) on
  another node of the same run before it is ridden out (no loss declared). (A slow-link needs the
  kernel's netem, which this machine's kernel lacks; the drill says so.)
- power-off on the replica path: heal_replica, and the survivors go on before their collective
  timeout (they are freed at the controller's word, not by gloo's timeout).
- partition --seconds 10: the node comes back to a run that replaced it; it commits nothing (0
  foreign commits) and the run ends with the same bytes as a run without the flap.
- the controller cut off from every node for a few seconds (they still reach one another): every
  heartbeat stops at once, the controller suspects itself and declares no node lost.
- two services on one PostgreSQL registry, each on a host of its own, the database on a third: the
  leader cut off from the cluster (not from the database), then the new leader cut off from the
  database (not from the cluster). Each time the cut-off one stops acting within 10 s, the standby
  takes the lock and the run, and the run ends as if nothing happened (no node declared lost).
The lab's teardown removes every namespace, veth and bridge it made (checked)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.support.lab import Lab, LabRayCluster, available
from tests.support.postgres import PostgresServer, unavailable
from tests.support.serve import Serve, wait_for, write_spec
from tests.support.tools import require

pytestmark = pytest.mark.cluster

WORKERS = ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]
CONTROLLERS = ["ctl-a", "ctl-b"]
"""Hosts for two services on one PostgreSQL registry (on host `db`), a leader and its standby."""
HANG_FLOOR_S = 30.0
COLLECTIVE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    require(available())
    lab = Lab(["head", *WORKERS, *CONTROLLERS, "db"]).open()
    try:
        yield lab
    finally:
        lab.close()
        assert lab.leftovers() == [], f"the lab left {lab.leftovers()} behind"


@pytest.fixture(scope="module")
def cluster(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabRayCluster]:
    c = LabRayCluster(lab, tmp_path_factory.mktemp("lab-ray"), workers=WORKERS, spares=1)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def service(lab: Lab, cluster: LabRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("lab-serve")
    serve = Serve(tmp / "state", tmp / "serve.log", "--address", cluster.address, "--advertise-host", lab.gateway,
                  env={**cluster.env, "GOODPUT_STATE_DIR": str(tmp / "state")})
    try:
        yield serve.start()
    finally:
        serve.stop()


def lab_spec(tmp: Path, name: str, *, steps: int, replicas: int = 1) -> Path:
    path = write_spec(tmp / f"{name}.yaml", name, steps=steps, dp=4, every_steps=10)
    spec = yaml.safe_load(path.read_text())
    spec["health"] = {"collective_timeout_s": COLLECTIVE_TIMEOUT_S, "hang_floor_s": HANG_FLOOR_S}
    spec["checkpoint"]["peer_every_steps"] = 1
    spec.setdefault("cluster", {})["interface"] = "eth0"  # (a lab host's one link: what its ranks bind to)
    if replicas > 1:
        spec["parallelism"]["dp_replicas"] = replicas
        spec["elastic"] = {"failure_domain": "replica"}
    path.write_text(yaml.safe_dump(spec))
    return path


def submit_with_spare(service: Serve, path: Path) -> None:
    """Submit once the service holds a free spare again (a repaired node refills the pool): each test's
    run has a spare to be replaced by, whatever the tests before it left."""
    deadline = time.monotonic() + 120
    while True:
        view = service.json("nodes")
        assert isinstance(view, dict)
        if any(n["state"] == "spare" and not n["run"] for n in view["nodes"]):
            break
        assert time.monotonic() < deadline, f"no spare came back: {view['nodes']}"
        time.sleep(1)
    service.cli("submit", str(path))


def drill(service: Serve, run: str, kind: str, *args: str) -> dict[str, Any]:
    report = service.json("drill", run, kind, *args)
    assert isinstance(report, dict)
    print(f"\n{run} {kind}: " + json.dumps({k: report.get(k) for k in (
        "target", "decision", "outcome", "detection_s", "recovery_s", "steps_lost", "restored_from")}))
    return report


def events(service: Serve, run: str, *kinds: str) -> list[dict]:
    found = service.json("events", run)
    assert isinstance(found, list)
    return [e for e in found if not kinds or e["kind"] in kinds]


def victim(status: dict, rank: int = -1) -> str:
    return status["placement"][rank]["node"]


def test_power_off_is_detected_from_heartbeats_and_a_lossy_link_is_not_a_loss(
        service: Serve, cluster: LabRayCluster, tmp_path: Path) -> None:
    submit_with_spare(service, lab_spec(tmp_path, "dark-world", steps=90))
    status = wait_for(service, "dark-world", lambda s: s["step"] >= 5)
    lossy, dark = victim(status, 0), victim(status)
    assert lossy != dark
    drill(service, "dark-world", "lossy-link", "--target", lossy, "--loss", "5", "--no-wait")
    wait_for(service, "dark-world", lambda s: s["step"] >= 25)
    try:
        report = drill(service, "dark-world", "power-off", "--target", dark)
        assert report["cause"] == "node_lost" and report["attributed_to"]["nodes"] == [dark], report
        assert report["decision"] == "replace" and report["outcome"] == "recovered", report
        assert report["detection_s"] < HANG_FLOOR_S, "before the hang verdict, the only way it was seen before"
        run = wait_for(service, "dark-world", lambda s: s["state"] == "succeeded")
    finally:
        cluster.repair(dark)
        cluster.mend_link(lossy)
    detected = events(service, "dark-world", "failure_detected")
    assert len(detected) == 1 and "went silent" in detected[0]["detail"]["message"], detected
    lossy_report = next(d for d in run["drills"] if d["kind"] == "lossy-link")
    assert lossy_report["outcome"] == "recovered" and lossy_report["cause"] == "node_lost", \
        "the only failure the run saw is the power-off's (its report is the lossy link's first failure)"
    assert run["step"] == 90 and run["attempt"] == 1


def test_power_off_of_a_replica_frees_the_survivors_at_the_controllers_word(
        service: Serve, cluster: LabRayCluster, tmp_path: Path) -> None:
    submit_with_spare(service, lab_spec(tmp_path, "dark-replica", steps=80, replicas=2))
    status = wait_for(service, "dark-replica", lambda s: s["step"] >= 10)
    dark = victim(status)
    try:
        report = drill(service, "dark-replica", "power-off", "--target", dark)
        assert report["decision"] == "heal_replica" and report["outcome"] == "recovered", report
        assert report["recovery_s"] < COLLECTIVE_TIMEOUT_S, \
            "the survivors' next step came before their collective would have timed out"
        assert report["survivors_told_at"] is not None
        run = wait_for(service, "dark-replica", lambda s: s["state"] == "succeeded")
    finally:
        cluster.repair(dark)
    assert run["attempt"] == 0 and run["step"] == 80, "the survivors never stopped: one attempt"
    agreed = events(service, "dark-replica", "replica_checksums")
    assert agreed and all(e["detail"]["agree"] for e in agreed), agreed[-3:]


def manifests(root: Path, run: str) -> dict[int, dict]:
    return {int(p.parent.name.removeprefix("step-")): json.loads(p.read_text())
            for p in (root / run).glob("step-*/manifest.json")}


def test_a_partition_that_heals_commits_nothing_foreign_and_ends_as_a_run_without_it(
        service: Serve, cluster: LabRayCluster, tmp_path: Path) -> None:
    steps = 80
    submit_with_spare(service, lab_spec(tmp_path, "flap", steps=steps))
    status = wait_for(service, "flap", lambda s: s["step"] >= 12)
    cut = victim(status)
    try:
        report = drill(service, "flap", "partition", "--target", cut, "--seconds", "10")
        assert report["decision"] == "replace" and report["outcome"] == "recovered", report
        time.sleep(12)  # the link is back: the cut-off ranks meet a run that has gone on without them
        wait_for(service, "flap", lambda s: s["state"] == "succeeded")
    finally:
        cluster.repair(cut)
    service.cli("submit", str(lab_spec(tmp_path, "steady", steps=steps)))
    wait_for(service, "steady", lambda s: s["state"] == "succeeded")
    root = tmp_path / "ckpt"
    flap, steady = manifests(root, "flap"), manifests(root, "steady")
    starts = {record["attempt"]: record["start_step"] for record in
              (json.loads(p.read_text()) for p in (root / "flap.fence").glob("attempt-*.json"))}
    assert sorted(starts) == [0, 1], starts
    foreign = [step for step, m in flap.items() if m["attempt"] == 0 and step > starts[1]]
    print(f"\npartition --seconds 10: {len(foreign)} foreign commits; attempt 1 started from step {starts[1]}")
    assert foreign == [], f"attempt 0 committed steps {foreign} after attempt 1 replaced it"
    shards = {rel: d for rel, d in flap[steps]["files"].items() if rel != ".metadata"}  # (it names the run)
    assert shards and shards == {rel: d for rel, d in steady[steps]["files"].items() if rel != ".metadata"}, \
        "the final state differs from the run without the flap"


def test_a_controller_cut_off_from_every_node_suspects_itself(service: Serve, cluster: LabRayCluster,
                                                               tmp_path: Path) -> None:
    service.cli("submit", str(lab_spec(tmp_path, "alone", steps=70)))
    wait_for(service, "alone", lambda s: s["step"] >= 10)
    cluster.lab.cut_controller()  # the nodes train on; this controller hears none of them
    try:
        time.sleep(5)
    finally:
        cluster.lab.mend_controller()
        mended_at = time.time()
    run = wait_for(service, "alone", lambda s: s["state"] == "succeeded")
    isolated = events(service, "alone", "controller_isolated")
    assert isolated and isolated[0]["detail"]["isolated"], "it noticed it heard no node at all"
    # while cut off, not after: a poll that waits on Ray's GCS for the cut's length learns of it too late
    assert isolated[0]["time"] < mended_at, (isolated[0]["time"], mended_at)
    assert not events(service, "alone", "failure_detected"), "and declared none of them lost"
    assert run["attempt"] == 0


def lab_serve(lab: Lab, cluster: LabRayCluster, tmp: Path, host: str, database: str, *args: str) -> Serve:
    """`goodput serve` on a lab host of its own, on the PostgreSQL registry `database`."""
    address, state = lab.nodes[host].address, tmp / host
    command = lab.command(host, [sys.executable, "-m", "controller", "serve", "--host", address, "--port", "0",
                                 "--state-dir", str(state), "--db", database, "--address", cluster.address,
                                 "--advertise-host", address, *args])
    return Serve(state, tmp / f"{host}-{time.monotonic_ns()}.log", command=command,
                 env={**cluster.env, "GOODPUT_TOKEN": "lab-token", "GOODPUT_STATE_DIR": str(state)})


def until_said(serve: Serve, offset: int, text: str, within_s: float) -> float:
    """When (time.monotonic) the service's log, from `offset`, says `text`; fails after `within_s`."""
    start = time.monotonic()
    while text not in serve.text()[offset:]:
        assert time.monotonic() - start < within_s, f"not said within {within_s} s: {text!r}\n{serve.text()[-3000:]}"
        time.sleep(0.1)
    return time.monotonic()


def test_a_cut_off_controller_stops_within_10_s_and_its_standby_takes_the_run(
        lab: Lab, cluster: LabRayCluster, service: Serve, tmp_path: Path) -> None:
    require(unavailable())
    db = PostgresServer(lab.nodes["db"].address, within=lambda argv: lab.command("db", argv))
    # (enough steps to outlast both handovers: the lab's steps take ~0.1 s, and 150 of them once ended
    # as the standby took over, which then waited for 5 more steps that never came)
    steps, figures = 400, {}
    try:
        leader = lab_serve(lab, cluster, tmp_path, "ctl-a", db.url).start()
        standby = lab_serve(lab, cluster, tmp_path, "ctl-b", db.url, "--standby")
        waits = standby.launch()
        until_said(standby, waits, "ready to take over", 120)
        submit_with_spare(leader, lab_spec(tmp_path, "handover", steps=steps))
        wait_for(leader, "handover", lambda s: s["step"] >= 10)

        # 1. The leader cut off from the cluster, not from the database: it yields to the standby.
        said = len(leader.text())
        lab.block("ctl-a", [lab.gateway, *(lab.nodes[h].address for h in ["head", *WORKERS])])
        cut = time.monotonic()
        figures["cluster cut: old leader stopped acting (s)"] = until_said(leader, said, "lost the Ray cluster", 10) - cut
        assert "yielding the lock and the runs to it" in leader.text()[said:]
        figures["cluster cut: standby leads (s)"] = until_said(standby, waits, "leading now", 60) - cut
        assert leader.proc is not None and leader.proc.wait(10) == 3, leader.text()[-3000:]
        standby.wait_api(waits, timeout_s=60)
        taken = wait_for(standby, "handover", lambda s: s["state"] in ("running", "succeeded"))
        at = taken["step"]
        assert taken["state"] == "running" and at + 5 <= steps, \
            f"the run was {taken['state']} at step {at} of {steps} when the standby took it: give it more steps"
        wait_for(standby, "handover", lambda s: s["step"] >= at + 5)
        lab.kill_all("ctl-a")  # (its raylet, cut off meanwhile)
        lab.unblock("ctl-a")

        # 2. The new leader cut off from the database, not from the cluster: it stops; the old one,
        # back as a standby, takes over.
        leader, standby = standby, lab_serve(lab, cluster, tmp_path, "ctl-a", db.url, "--standby")
        waits = standby.launch()
        until_said(standby, waits, "ready to take over", 120)
        lab.block("ctl-b", [lab.nodes["db"].address])
        cut = time.monotonic()
        assert leader.proc is not None
        while leader.proc.poll() is None:
            assert time.monotonic() - cut < 10, leader.text()[-3000:]
            time.sleep(0.1)
        figures["database cut: old leader stopped (s)"] = time.monotonic() - cut
        assert leader.proc.returncode == 4 and "lost the registry's lock" in leader.text(), leader.text()[-3000:]
        figures["database cut: standby leads (s)"] = until_said(standby, waits, "leading now", 60) - cut
        standby.wait_api(waits, timeout_s=60)
        run = wait_for(standby, "handover", lambda s: s["state"] == "succeeded")
        print("\n" + json.dumps({k: round(v, 1) for k, v in figures.items()}))
        assert run["step"] == steps
        assert not events(standby, "handover", "failure_detected"), "no node was declared lost"
    finally:
        for host in CONTROLLERS:
            lab.kill_all(host)
            lab.unblock(host)
        db.stop()
