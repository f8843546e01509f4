"""The controller exactly as deploy/overlays/prod runs it, against a Ray cluster of `ray start` nodes
that are each on a loopback address of their own, the way separate hosts are.

The Deployment is rendered with kustomize; the controller container's command (the image's
entrypoint + its args) is run with the environment Kubernetes would give it. What a pod has and this
machine does not is mapped, and nothing else:
- the cluster's service names: goodput-head-svc:6379 -> the head's GCS at 127.0.0.2;
- the pod: its IP (POD_IP) is 127.0.0.9, where `--host=0.0.0.0` listens (a free port for 8470), and
  the PVC at GOODPUT_STATE_DIR is a temp dir;
- the Secrets: the API token, and the registry URL (GOODPUT_DB) of a real PostgreSQL server on
  127.0.0.10;
- `--kubernetes=on` -> off: no Kubernetes API server can run here (tests/unit/test_k8s.py covers
  that adapter).
(The standby test runs first: the other one kills a node of the module's cluster.)
The Ray head is on 127.0.0.2 and three labelled workers (one a spare) on 127.0.0.3-5. The controller
joins the cluster as a node with no resources at 127.0.0.9 (deploy/base/controller.yaml says why not
through Ray Client). A run is submitted and survives a kill-node drill over REST; the controller is
SIGKILLed and started again with the same command, and re-attaches to the run; the controller's
process is stopped for 40 s (SIGSTOP) and continued; the run succeeds with no other failure, its
timeline intact in PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest

from controller.placement import recorded_nodes
from tests.support.postgres import PostgresServer, module_server
from tests.support.ray_start import LOOPBACK_ENV, RayStartCluster, free_port
from tests.support.serve import Serve, wait_for, write_spec
from tests.unit.test_deploy import needs_kubectl, one, render

pytestmark = [pytest.mark.cluster, needs_kubectl]

HEAD, WORKERS, POD_IP = "127.0.0.2", ["127.0.0.3", "127.0.0.4", "127.0.0.5"], "127.0.0.9"
TOKEN = "deployed-test-token"
STEPS = 650
"""The deployed run must outlast a kill-node, a container restart and 40 s of its controller stopped, with
time left to show nothing was taken for a failure after: here it was back at ~step 430 (0.18 s a step),
so 650 leaves it ~40 s (900 left it 84 s)."""
STANDBY_STEPS = 250
"""The standby's run: it re-attached at ~step 140 (27 s in, 0.2 s a step); 250 leaves it ~20 s (400 left 56 s)."""


@pytest.fixture(scope="module")
def several_hosts() -> Iterator[None]:
    """Raylets and the service on 127.0.0.2, .3 ... are other hosts: an in-process cluster of an earlier
    module, still open (tests/cluster/conftest.py's, package-scoped), marks this process's environment
    single-machine (LOOPBACK_ENV), which `ray start` on those addresses refuses."""
    saved = {k: os.environ.pop(k) for k in list(LOOPBACK_ENV) if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@pytest.fixture(scope="module")
def cluster(several_hosts: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayStartCluster]:
    c = RayStartCluster(tmp_path_factory.mktemp("ray"), head_ip=HEAD, worker_ips=WORKERS, default_health_checks=True)
    try:
        yield c.start(nodes=3, spares=1)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from module_server("127.0.0.10")  # the database is another host too


def deployed_command(services: dict[str, str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The controller container's command line and environment as Kubernetes would run it from the
    rendered prod overlay, with the cluster's service names mapped to `services` and the pod's and
    Secrets' values from `env`."""
    docs = render("prod")
    container = one(docs, "Deployment", "goodput-controller")["spec"]["template"]["spec"]["containers"][0]
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):  # envFrom first; env entries override it
        values.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            values[entry["name"]] = entry["value"]
        elif entry["name"] in env:
            values[entry["name"]] = env[entry["name"]]
        else:  # a fieldRef or Secret this test does not give: only optional ones may be missing
            assert entry["valueFrom"].get("secretKeyRef", {}).get("optional"), f"{entry['name']} has no value here"
    values.update({k: v for k, v in env.items() if k not in values})
    for name, value in list(values.items()):
        for service, address in services.items():
            value = value.replace(service, address)
        values[name] = value

    def expand(arg: str) -> str:  # Kubernetes' $(VAR) expansion
        return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg)

    args = [expand(a) for a in container["args"]]
    pod = {"--host=0.0.0.0": f"--host={env['POD_IP']}", "--port=8470": f"--port={env['API_PORT']}",
           "--kubernetes=on": "--kubernetes=off"}
    args = [pod.get(a, a) for a in args]
    entrypoint = [str(Path(sys.executable).parent / "goodput")]  # deploy/Dockerfile: ENTRYPOINT ["goodput"]
    return entrypoint + args, {**os.environ, **values}


def test_a_standby_replica_takes_over_when_the_leader_dies(cluster: RayStartCluster, postgres: PostgresServer,
                                                           tmp_path: Path) -> None:
    """overlays/prod runs two replicas with --standby. Each pod (127.0.0.9 and 127.0.0.11 here) runs
    the same command on the same PostgreSQL registry: one leads; the other answers /healthz but not
    /readyz, and drives nothing. The leader is SIGKILLed mid-run: the standby takes the registry's
    lock, re-attaches to the run and finishes it. The takeover time (SIGKILL -> the standby's API up)
    is printed."""
    replicas = []
    for i, pod_ip in enumerate((POD_IP, "127.0.0.11")):
        state = tmp_path / f"state-{i}"
        command, env = deployed_command(
            {"goodput-head-svc:6379": cluster.address},
            {"POD_IP": pod_ip, "API_PORT": str(free_port(pod_ip)), "GOODPUT_TOKEN": TOKEN,
             "GOODPUT_DB": postgres.url, "GOODPUT_STATE_DIR": str(state)})
        assert "--standby" in command
        replicas.append(Serve(state, tmp_path / f"serve-{i}.log", command=command, env=env, own_session=True))
    leader, standby = replicas
    try:
        assert cluster.raylet_ips() == {HEAD, *WORKERS}
        leader.start()
        offset = standby.launch()
        standby.wait_text(offset, "standby: another goodput serve leads")
        port = next(a for a in standby.command if a.startswith("--port=")).split("=", 1)[1]
        base = f"http://127.0.0.11:{port}"
        assert httpx.get(f"{base}/healthz", timeout=10).json() == {"status": "standby"}
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 503
        assert httpx.get(f"{base}/v1/runs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 503
        assert httpx.get(f"{leader.url}/readyz", timeout=10).json() == {"status": "leading"}

        leader.cli("submit", str(write_spec(tmp_path / "ha.yaml", "ha", steps=STANDBY_STEPS, dp=2)))
        wait_for(leader, "ha", lambda s: s["step"] >= 12)
        leader.kill_container()  # the leader's pod restarts: serve and its raylet go together
        killed = time.monotonic()
        standby.wait_api(offset)
        takeover_s = time.monotonic() - killed
        print(f"standby takeover: {takeover_s:.1f} s from SIGKILL of the leader to the standby's API up")
        assert standby.url.startswith("http://127.0.0.11:")
        run = wait_for(standby, "ha", lambda s: s["state"] == "succeeded", timeout_s=300)
        assert run["attempt"] == 0 and run["step"] == STANDBY_STEPS, "the standby re-attached: no new attempt"
        restarted = _events(standby, "service_restarted", "ha")
        assert len(restarted) == 1 and "re-attached" in restarted[0]["detail"]["action"], restarted
        assert "leading now, after" in standby.text()
        # each replica joined as a node of its own; the killed leader's raylet went with its container
        assert cluster.raylet_ips() == {HEAD, *WORKERS, "127.0.0.11"}
        assert _free_gpus_and_reservations(cluster, 6.0, "127.0.0.11") == (6.0, []), \
            "the ended run holds nothing in the cluster"
    finally:
        for replica in replicas:
            replica.stop()


def test_the_deployed_controller_drives_a_run_across_hosts(cluster: RayStartCluster, postgres: PostgresServer,
                                                           tmp_path: Path) -> None:
    assert cluster.raylet_ips() >= {HEAD, *WORKERS}
    state = tmp_path / "state"
    command, env = deployed_command(
        {"goodput-head-svc:6379": cluster.address},
        {"POD_IP": POD_IP, "API_PORT": str(free_port(POD_IP)), "GOODPUT_TOKEN": TOKEN,
         "GOODPUT_DB": postgres.url, "GOODPUT_STATE_DIR": str(state)})
    assert f"--address={cluster.address}" in command and f"--advertise-host={POD_IP}" in command, command
    assert "--db=postgresql+psycopg://" in " ".join(command), command
    serve = Serve(state, tmp_path / "serve.log", command=command, env=env, own_session=True)
    try:
        serve.start()
        assert serve.url.startswith(f"http://{POD_IP}:"), serve.url
        assert POD_IP in cluster.raylet_ips(), "the controller joined as a node of its own"
        serve.cli("submit", str(write_spec(tmp_path / "dep.yaml", "dep", steps=STEPS, dp=2)))
        wait_for(serve, "dep", lambda s: s["step"] >= 12)
        started = _events(serve, "attempt_started")
        nodes = recorded_nodes(started[0]["detail"]["placement"])
        assert nodes <= {"ext-0", "ext-1"}, nodes

        target = sorted(nodes)[-1]
        node_processes = _node_processes(cluster, WORKERS[int(target.removeprefix("ext-"))])
        assert len(node_processes) > 3, node_processes  # its raylet, its workers, the ranks they forked
        report = serve.json("drill", "dep", "kill-node", "--target", target)  # over REST
        assert isinstance(report, dict)
        assert report["outcome"] == "recovered" and report["decision"] == "replace", report
        # A node loss: every process of the node ended with it (the ranks' training processes too),
        # and the failure was detected as fast as on the embedded cluster, on Ray's default health checks.
        assert not [p for p in node_processes if _running(p)], "processes of the killed node live on"
        assert report["cause"] == "node_lost" and report["detection_s"] < 5.0, report
        wait_for(serve, "dep", lambda s: s["attempt"] == 1 and s["step"] >= report["at_step"] + 10)

        serve.kill_container()  # a container restart: serve and the raylet it joined with, together
        time.sleep(3)  # the workers train on without their controller; the cluster still lists its node
        restarting = time.monotonic()
        serve.start()  # the same command, in the restarted container (same pod IP)
        restarted = _events(serve, "service_restarted")
        assert len(restarted) == 1 and "re-attached" in restarted[0]["detail"]["action"], restarted
        rejoined_s = time.monotonic() - restarting
        print(f"controller container restart: joined again and re-attached in {rejoined_s:.1f} s")
        assert rejoined_s < 60, rejoined_s

        # The controller's process stops for 40 s (its node's raylet does not): the run trains on
        # without it, and nothing is taken for a failure once it is back.
        serve.proc.send_signal(signal.SIGSTOP)
        time.sleep(40)
        serve.proc.send_signal(signal.SIGCONT)
        run = wait_for(serve, "dep", lambda s: s["state"] == "succeeded", timeout_s=400)
        assert run["attempt"] == 1 and run["step"] == STEPS
        assert len(_events(serve, "failure_detected")) == 1, "the drill's, and nothing since"
        assert [e["attempt"] for e in _events(serve, "attempt_started")] == [0, 1]
        assert "registry postgresql+psycopg://" in serve.text()
        # The killed node's 2 slots are gone; the run, re-attached, released the rest.
        assert _free_gpus_and_reservations(cluster, 4.0) == (4.0, [])
    finally:
        serve.stop()


def _free_gpus_and_reservations(cluster: RayStartCluster, want_gpus: float,
                                node_ip: str = POD_IP) -> tuple[float, list[str]]:
    """Asked of Ray by a driver of its own (on a controller's node, `node_ip`): the GPU slots free in
    the cluster, and the placement groups not removed. Waits up to 20 s for removals to land. (The
    answer's line is marked: Ray prints what GCS tells drivers, a node marked dead say, to stdout too.)"""
    code = ("import json, ray; ray.init(address=%r, _node_ip_address=%r, logging_level='ERROR'); "
            "print('answer:' + json.dumps([ray.available_resources().get('GPU', 0.0), [v['name'] for v in "
            "ray.util.placement_group_table().values() if v['state'] != 'REMOVED']]))") % (cluster.address, node_ip)
    deadline = time.monotonic() + 20
    while True:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (answer,) = [line for line in proc.stdout.splitlines() if line.startswith("answer:")]
        gpus, groups = json.loads(answer.removeprefix("answer:"))
        if (gpus, groups) == (want_gpus, []) or time.monotonic() > deadline:
            return gpus, groups
        time.sleep(1)


def _node_processes(cluster: RayStartCluster, ip: str) -> list[psutil.Process]:
    """The raylet at `ip` and every process under it."""
    for p in cluster.processes():
        try:
            if p.name() == "raylet" and f"--node_ip_address={ip}" in p.cmdline():
                return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no raylet at {ip}")


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _events(serve: Serve, kind: str, run: str = "dep") -> list[dict[str, Any]]:
    events = serve.json("events", run)
    assert isinstance(events, list)
    return [e for e in events if e["kind"] == kind]
