"""The Kubernetes adapter at the HTTP level: the official client against a local API stand-in that
answers like the real server (tests/support/fake_kube.py). Quarantine cordons and taints in one
patch that carries the resourceVersion, a concurrent change is re-read and kept, 429/5xx are retried
and then given up on, 401/403/404 say what to fix; release undoes only what goodput did; racks come
from node labels; the service cordons what a run quarantines and releases on an operator's word."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from controller.k8s.cluster import KubeTopologyCluster
from controller.k8s.labels import write_labels
from controller.k8s.nodes import CORDONED_BY, TAINT_KEY, KubeError, KubeNodes, taint_value
from controller.k8s.topology import discover
from controller.topology import Node, Topology
from tests.support.fake_kube import ADMIN, NO_RBAC, FakeKube, node

GPU_NODE_LABELS = {"topology.kubernetes.io/zone": "rack-a", "nvidia.com/gpu.memory": "81920"}


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    server = FakeKube([
        node("gpu-1", GPU_NODE_LABELS),
        node("gpu-2", {"topology.kubernetes.io/zone": "rack-b", "nvidia.com/gpu.clique": "clique-7"}),
        node("gpu-3", {}, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
    ])
    yield server
    server.stop()


def nodes(kube: FakeKube, token: str = ADMIN) -> KubeNodes:
    return KubeNodes.from_url(kube.url, token, sleep=lambda s: None)


def test_quarantine_cordons_and_taints_in_one_versioned_patch(kube: FakeKube) -> None:
    outcome = nodes(kube).quarantine("gpu-3", "sdc: parameters changed at rest on rank 7")
    assert outcome.action == "cordoned"
    n = kube.nodes["gpu-3"]
    assert n["spec"]["unschedulable"] is True
    assert {"key": TAINT_KEY, "value": "sdc-parameters-changed-at-rest-on-rank-7", "effect": "NoSchedule"} in \
        n["spec"]["taints"]
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in n["spec"]["taints"], \
        "the node's other taints stay"
    assert n["metadata"]["annotations"][CORDONED_BY] == "goodput"
    (patch,) = kube.patches()
    assert patch["body"]["metadata"]["resourceVersion"] == "1"
    assert patch["content_type"].startswith("application/") and "patch" in patch["content_type"]
    assert patch["authorization"] == f"Bearer {ADMIN}"
    again = nodes(kube).quarantine("gpu-3", "sdc")
    assert again.action == "already" and len(kube.patches()) == 1


def test_a_concurrent_change_is_read_again_and_kept(kube: FakeKube) -> None:
    def operator_taints(n: dict) -> None:  # between goodput's read and its patch
        n["spec"]["taints"].append({"key": "maintenance", "value": "bios", "effect": "NoExecute"})

    kube.before_patch = operator_taints
    nodes(kube).quarantine("gpu-1", "straggler")
    statuses = [r["method"] for r in kube.requests]
    assert statuses == ["GET", "PATCH", "GET", "PATCH"], "409 on the stale version, then read again"
    keys = {t["key"] for t in kube.nodes["gpu-1"]["spec"]["taints"]}
    assert keys == {"maintenance", TAINT_KEY}


def test_throttling_and_server_errors_are_retried_then_given_up(kube: FakeKube) -> None:
    kube.fail_next = [503, 429, 500]
    assert nodes(kube).quarantine("gpu-1", "sdc").action == "cordoned"
    assert len(kube.requests) == 5
    kube.fail_next = [503] * 20
    with pytest.raises(KubeError, match=r"gave up after 6 attempts \(last: 503"):
        nodes(kube).release("gpu-1")


@pytest.mark.parametrize("token, name, says", [
    (NO_RBAC, "gpu-1", "may not patch nodes; apply deploy/'s ClusterRole goodput-nodes"),
    ("", "gpu-1", "401"),
    (ADMIN, "gpu-9", "no such Kubernetes node"),
])
def test_refusals_say_what_to_fix(kube: FakeKube, token: str, name: str, says: str) -> None:
    with pytest.raises(KubeError, match=says):
        nodes(kube, token).quarantine(name, "sdc")
    assert not kube.patches()


def test_release_undoes_only_what_goodput_did(kube: FakeKube) -> None:
    k = nodes(kube)
    k.quarantine("gpu-1", "sdc")
    assert k.release("gpu-1").detail == "taint removed; uncordoned"
    n = kube.nodes["gpu-1"]
    assert n["spec"]["unschedulable"] is False and n["spec"]["taints"] == []
    assert CORDONED_BY not in n["metadata"]["annotations"]
    kube.nodes["gpu-2"]["spec"]["unschedulable"] = True  # an operator cordoned it first
    k.quarantine("gpu-2", "sdc")
    assert kube.nodes["gpu-2"]["metadata"]["annotations"][CORDONED_BY] == "other"
    assert "left cordoned" in k.release("gpu-2").detail
    assert kube.nodes["gpu-2"]["spec"]["unschedulable"] is True and kube.nodes["gpu-2"]["spec"]["taints"] == []


def test_taint_values_are_valid_label_values() -> None:
    assert taint_value("node_lost") == "node_lost"
    assert taint_value("sdc: rank [3] (x)") == "sdc-rank-3-x"
    assert len(taint_value("x" * 200)) == 63 and taint_value("::") == "quarantined"


def ray_topology(*names: str) -> Topology:
    return Topology(tuple(Node(name=n, rack="rack-0", num_gpus=8, gpu_memory_bytes=80 * 2**30) for n in names))


def test_racks_come_from_node_labels_domain_first() -> None:
    labels = {"gpu-1": GPU_NODE_LABELS, "gpu-2": {"topology.kubernetes.io/zone": "rack-b",
                                                  "nvidia.com/gpu.clique": "clique-7"}}
    racks = {n.name: n.rack for n in discover(ray_topology("gpu-1", "gpu-2", "elsewhere"), labels).nodes}
    assert racks == {"gpu-1": "rack-a", "gpu-2": "clique-7", "elsewhere": "rack-0"}
    site = discover(ray_topology("gpu-1"), {"gpu-1": {"example.com/rack": "r17"}}, rack_label="example.com/rack",
                    domain_label=None)
    assert site.nodes[0].rack == "r17"
    assert ray_topology("gpu-1").with_racks({"gpu-1": "mine"}).nodes[0].rack == "mine"


class StaticCluster:
    def __init__(self, topology: Topology) -> None:
        self._topology = topology
        self.killed: list[str] = []

    def topology(self, within_s: float | None = None) -> Topology:
        return self._topology

    def kill_node(self, name: str) -> None:
        self.killed.append(name)


def test_topology_discovery_reads_labels_at_most_every_refresh_and_survives_an_outage(kube: FakeKube) -> None:
    clock = [0.0]
    cluster = KubeTopologyCluster(StaticCluster(ray_topology("gpu-1", "gpu-2")), nodes(kube), refresh_s=30,
                                  clock=lambda: clock[0])
    assert [n.rack for n in cluster.topology().nodes] == ["rack-a", "clique-7"]
    cluster.topology()
    assert sum(1 for r in kube.requests if r["path"].startswith("/api/v1/nodes") and r["method"] == "GET") == 1
    clock[0] = 31.0
    kube.fail_next = [503] * 20
    assert [n.rack for n in cluster.topology().nodes] == ["rack-a", "clique-7"], "the last labels stay"
    cluster.kill_node("gpu-1")  # everything else is the Ray cluster's
    assert cluster.inner.killed == ["gpu-1"]


def test_the_init_container_writes_the_ray_labels_of_its_node(kube: FakeKube, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "labels.yaml"
    labels = write_labels("gpu-1", out, rack_label="topology.kubernetes.io/zone", domain_label="nvidia.com/gpu.clique",
                          spare=True, url=kube.url, token=ADMIN)
    assert labels == yaml.safe_load(out.read_text()) == {"node": "gpu-1", "rack": "rack-a", "gpu_memory_gb": "80",
                                                          "spare": "true"}
    from controller.cli.main import main

    monkeypatch.setenv("NODE_NAME", "gpu-2")
    monkeypatch.setenv("RAY_GROUP", "gpu")
    monkeypatch.setenv("KUBE_TOKEN", ADMIN)
    with pytest.raises(SystemExit) as done:
        main(["k8s-node-labels", "--out", str(out), "--api-url", kube.url, "--spare-group", "spare"])
    assert done.value.code == 0
    assert yaml.safe_load(out.read_text()) == {"node": "gpu-2", "rack": "clique-7"}


@pytest.mark.timing  # the cordon's thread, waited for 2.5 s of wall time
def test_the_service_cordons_what_a_run_quarantines_and_releases_on_request(kube: FakeKube) -> None:
    from fastapi.testclient import TestClient

    from controller.run_state import RunState
    from controller.service.app import create_app
    from controller.service.registry import Registry
    from controller.service.service import Service
    from controller.spec import parse_spec
    from tests.unit.fakes import FakeCluster, FakeWorkerGroup, ManualClock, drive
    from tests.unit.test_api import BASE

    raw = copy.deepcopy(BASE) | {"drills": [], "parallelism": {"dp": 2, "tp": 1, "pp": 1}}
    raw["cluster"] = {"local": {"nodes": 3, "gpus_per_node": 1, "racks": 1, "spares": 1}}
    spec = parse_spec(raw)
    group = FakeWorkerGroup()
    clock = ManualClock(100.0)
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: group, clock=clock,
                      threads=False, node_actions=nodes(kube))
    kube.nodes.update({f"node-{i}": node(f"node-{i}") for i in range(3)})
    service.add(spec)
    service.schedule()
    c = service.controller("tiny-gpt")
    t = drive(c, RunState.RUNNING, lambda t: service.advance("tiny-gpt", t))
    group.finish_steps(1, 3)
    group.emit(1, "sdc_suspect", step=3, ranks=[1], check="anomaly", clean_through_step=2, evidence={"x": 1})
    service.advance("tiny-gpt", t)
    bad = c.quarantined[0]["node"]
    deadline = t + 50
    while not any(e.kind == "node_cordoned" for e in c.events) and t < deadline:  # the cordon runs in a thread
        import time

        time.sleep(0.05)
        t += 1
    cordoned = next(e for e in c.events if e.kind == "node_cordoned")
    assert cordoned.detail["node"] == bad and cordoned.detail["action"] == "cordoned"
    assert kube.nodes[bad]["spec"]["unschedulable"] is True
    api = TestClient(create_app(service))
    view = {n["name"]: n for n in api.get("/v1/nodes").json()["nodes"]}
    assert view[bad]["state"] == "quarantined"
    released = api.post(f"/v1/nodes/{bad}/release")
    assert released.status_code == 200, released.text
    assert released.json()["kubernetes"] == "taint removed; uncordoned"
    assert kube.nodes[bad]["spec"]["taints"] == [] and kube.nodes[bad]["spec"]["unschedulable"] is False
    service.advance("tiny-gpt", t + 1)  # the run's own quarantine list does not bring it back
    assert {n["name"]: n for n in api.get("/v1/nodes").json()["nodes"]}[bad]["state"] != "quarantined"
    again = api.post(f"/v1/nodes/{bad}/release")
    assert again.status_code == 404 and "goodput nodes" in again.json()["error"]["message"]
    assert api.post("/v1/nodes/bad name!/release").status_code in (404, 422)


def test_nodes_cordoned_or_tainted_to_go_are_departing_but_not_goodputs_own_quarantine() -> None:
    server = FakeKube([
        node("gpu-1", {}),
        node("gpu-2", {}, taints=[{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000",
                                   "effect": "NoSchedule"}]),
        node("gpu-3", {}, unschedulable=True),  # an operator's `kubectl drain`
        node("gpu-4", {}, taints=[{"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}]),
        node("gpu-5", {}, unschedulable=True, taints=[{"key": TAINT_KEY, "value": "sdc", "effect": "NoSchedule"}]),
        node("gpu-6", {}, taints=[{"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"}]),
    ])
    try:
        cluster = KubeTopologyCluster(StaticCluster(ray_topology("gpu-1", "gpu-2")), nodes(server))
        going = cluster.departing()
    finally:
        server.stop()
    assert set(going) == {"gpu-2", "gpu-3", "gpu-4"}, going
    assert "cluster autoscaler deletes it" in going["gpu-2"] and going["gpu-3"] == "cordoned"
    assert "spot interruption" in going["gpu-4"]
