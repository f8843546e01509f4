"""Every request answers without waiting for anything slow in every state, and cancel works in every
state, with the service's driver threads running: a store whose calls take 20 s and a launch that
takes as long as the test says are slow on purpose. Before, the checkpoint search and the launch ran
under the run's lock (cancel, drill requests and /metrics waited behind them), a submission probed
the store under the service's lock, and a run waiting for capacity spun on its cluster.

What is asserted is the cause, not a time on a shared 2-core machine: a request made while a store
call or a launch is held must come back while it is still held (it waited for neither). Where
nothing is held, a request may take at most WAIT_S, far beyond this machine's noise (a few hundred
ms) and far below the 20 s a held call takes."""

from __future__ import annotations

import copy
import inspect
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from checkpointing.store import LocalStore, StoreError
from controller.service.app import create_app
from controller.service.registry import Registry
from controller.service.service import Service
from controller.spec import RunSpec, SpecError
from controller.attempt import AttemptSpec
from controller.topology import Topology
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup, FlakyStore

pytestmark = pytest.mark.timing  # every API answer within WAIT_S while a store call is held

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
WAIT_S = 10.0
"""Longer than any answer takes on a busy machine, shorter than a held store call (20 s)."""


class GatedStore(FlakyStore):
    """Every call waits while the gate is shut, for at most 20 s (a store that takes 20 s per call)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.open = threading.Event()
        self.open.set()
        self.held: list[str] = []
        """The calls the shut gate has held (what each asked)."""
        self.passed = 0
        """Held calls that have gone on since (the gate opened, or their 20 s were up)."""

    def _call(self, what: str) -> None:
        if not self.open.is_set():
            self.held.append(what)
            self.open.wait(20)
            self.passed += 1
        super()._call(what)


class SlowLaunchGroup(FakeWorkerGroup):
    """`start` waits until the test lets it go, or until `abort` (as the Ray group's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.go.set()
        self.starting = threading.Event()
        self._aborted = threading.Event()

    def start(self, attempt: AttemptSpec) -> None:
        self.starting.set()
        while not self.go.is_set():
            if self._aborted.wait(0.02):
                raise RuntimeError("launch aborted")
        super().start(attempt)

    def abort(self) -> None:
        self._aborted.set()


class Setup:
    def __init__(self, tmp_path: Path, topology: Topology) -> None:
        self.store = GatedStore(LocalStore(tmp_path / "ckpt"))
        self.groups: dict[str, SlowLaunchGroup] = {}
        self.cluster = FakeCluster(topology)
        self.topology_calls = 0
        real = self.cluster.topology

        def counted(within_s: float | None = None) -> Topology:
            self.topology_calls += 1
            return real(within_s)

        self.cluster.topology = counted  # type: ignore[method-assign]
        self.service = Service(Registry(f"sqlite:///{tmp_path / 'reg.db'}"), self.cluster,
                               group_factory=self._group, injector_factory=lambda g: FakeInjector(g),  # type: ignore[arg-type]
                               store_factory=lambda spec: self.store, store_probe=self._probe, poll_s=0.05)
        self.service.start()
        self.api = TestClient(create_app(self.service))
        self.slowest: dict[str, float] = {}
        self.slow_launch = False

    def _probe(self, store: Any, uri: str) -> None:
        try:
            store.put_bytes(".probe", b"ok")
        except StoreError as e:
            raise SpecError(f"checkpoint.uri {uri!r} cannot be written: {e}") from None

    def _group(self, spec: RunSpec, run_id: str) -> SlowLaunchGroup:
        group = self.groups[run_id] = SlowLaunchGroup()
        if self.slow_launch:
            group.go.clear()
        return group

    def request(self, label: str, method: str, path: str, **kw: Any) -> Any:
        store_held = len(self.store.held) > self.store.passed
        passed = self.store.passed
        launching = [g for g in self.groups.values() if g.starting.is_set() and not g.go.is_set() and not g.started]
        t0 = time.perf_counter()
        response = self.api.request(method, path, **kw)
        took = time.perf_counter() - t0
        self.slowest[label] = max(self.slowest.get(label, 0.0), took)
        if store_held:
            assert self.store.passed == passed, f"{method} {path} ({label}) waited for a held store call"
        if launching:
            assert not any(g.started for g in launching), f"{method} {path} ({label}) waited for the launch"
        assert took < WAIT_S, f"{method} {path} took {took:.2f} s ({label})"
        assert response.status_code < 500, response.text
        return response

    def every_request(self, run_id: str, label: str) -> None:
        """The requests a user or Prometheus makes, each timed."""
        self.request(label, "GET", f"/v1/runs/{run_id}")
        self.request(label, "GET", "/v1/runs")
        self.request(label, "GET", f"/v1/runs/{run_id}/events")
        self.request(label, "GET", f"/v1/runs/{run_id}/checkpoints")
        self.request(label, "GET", "/v1/cluster")
        self.request(label, "GET", "/metrics")
        drill = self.request(label, "POST", f"/v1/runs/{run_id}/drills", json={"kind": "slow-rank", "at_step": 10**6})
        if drill.status_code == 202:
            self.request(label, "GET", f"/v1/drills/{drill.json()['id']}")
        other = self.request(label, "POST", "/v1/runs", json=spec(f"{run_id}-x", steps=5))
        if other.status_code == 201:  # (422 where the cluster has shrunk below it)
            self.request(label, "POST", f"/v1/runs/{other.json()['id']}/cancel")  # it would hold GPUs
            self.until(other.json()["id"], "cancelled")

    def state(self, run_id: str) -> str:
        return self.service.controller(run_id).state.value

    def until(self, run_id: str, state: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.state(run_id) != state:
            assert time.monotonic() < deadline, f"{run_id} is {self.state(run_id)}, not {state}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.store.open.set()
        for group in self.groups.values():
            group.go.set()
        self.service.stop()


def spec(name: str, **train: Any) -> dict:
    raw = copy.deepcopy(BASE)
    raw.update(name=name, drills=[], parallelism={"dp": 2, "tp": 2, "pp": 1})
    raw["train"].update(train)
    raw["elastic"] = {"min_dp": 2, "wait_for_capacity_s": 3600}
    return raw


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    s = Setup(tmp_path, Topology.from_local(nodes=2, gpus_per_node=2, racks=1, spares=0))
    yield s
    s.stop()


def test_requests_answer_within_a_second_and_cancel_works_in_every_state(setup: Setup) -> None:
    s = setup
    # launching, the store taking 20 s per call (the checkpoint search waits for it)
    s.store.open.clear()
    s.request("submit, store slow", "POST", "/v1/runs", json=spec("a"))  # its probe waits; the request does not
    s.until("a", "launching")
    deadline = time.monotonic() + 5
    while not any(what == "list of a/" for what in s.store.held):
        assert time.monotonic() < deadline, f"the launch should be asking the store for checkpoints: {s.store.held}"
        time.sleep(0.02)
    s.every_request("a", "launching, store slow")
    s.request("cancel", "POST", "/v1/runs/a/cancel")
    s.store.open.set()  # the call in flight returns; the driver sees the cancel before launching
    s.until("a", "cancelled")
    assert not s.groups["a"].started, "nothing was launched after the cancel"

    # launching, the workers slow to start: cancel makes the launch give up at once
    s.slow_launch = True
    s.request("submit", "POST", "/v1/runs", json=spec("b"))
    s.slow_launch = False
    s.until("b", "launching")
    assert s.groups["b"].starting.wait(5)
    s.every_request("b", "launching, launch slow")
    s.request("cancel", "POST", "/v1/runs/b/cancel")
    s.until("b", "cancelled")
    assert s.groups["b"]._aborted.is_set() and not s.groups["b"].started, "the launch in progress gave up"
    assert not s.groups["b"].go.is_set()  # by the cancel, not because it was let go

    # running, then recovering (a node lost, no spare, min_dp 2: waiting for capacity)
    s.request("submit", "POST", "/v1/runs", json=spec("c"))
    s.until("c", "running")
    s.every_request("c", "running")
    whole = s.cluster.nodes
    s.cluster.nodes = Topology(tuple(n for n in whole.nodes if n.name != "node-1"))
    s.groups["c"].lose_node("node-1")
    s.until("c", "recovering")
    calls = s.topology_calls
    time.sleep(1.0)
    assert s.topology_calls - calls <= 40, (f"waiting for capacity asked the cluster {s.topology_calls - calls} "
                                            "times in 1 s: it spins")
    s.every_request("c", "recovering")
    s.request("cancel", "POST", "/v1/runs/c/cancel")
    s.until("c", "cancelled")

    # pending behind capacity another run holds
    s.cluster.nodes = whole  # node-1 repaired
    s.request("submit", "POST", "/v1/runs", json=spec("d"))
    s.until("d", "running")
    s.request("submit", "POST", "/v1/runs", json=spec("e"))
    s.every_request("e", "pending")
    s.request("cancel", "POST", "/v1/runs/e/cancel")
    s.until("e", "cancelled")
    print("slowest answer per state:", {k: round(v, 3) for k, v in s.slowest.items()})


def test_a_store_that_refuses_the_probe_refuses_the_submission_and_a_slow_one_does_not(tmp_path: Path) -> None:
    s = Setup(tmp_path, Topology.from_local(nodes=2, gpus_per_node=2, racks=1, spares=0))
    try:
        s.store.down = True
        refused = s.request("submit, store down", "POST", "/v1/runs", json=spec("f"))
        assert refused.status_code == 422 and "cannot be written" in refused.json()["error"]["message"]
        s.store.down = False
        s.store.open.clear()
        accepted = s.request("submit, store slow", "POST", "/v1/runs", json=spec("g"))
        assert accepted.status_code == 201
    finally:
        s.stop()


def test_the_cluster_view_asks_the_cluster_outside_the_services_lock(setup: Setup) -> None:
    """/v1/cluster waits for its own answer from the cluster, but holds nothing while it does: a run
    submitted meanwhile (admission takes the service's lock) is answered while it is still held."""
    s = setup
    gate, asking = threading.Event(), threading.Event()
    counted = s.cluster.topology

    def held(within_s: float | None = None) -> Topology:
        if "cluster_view" in {frame.function for frame in inspect.stack(0)}:  # (not the scheduler's asking)
            asking.set()
            assert gate.wait(20), "never let go"
        return counted(within_s)

    s.cluster.topology = held  # type: ignore[method-assign]
    answers: list[int] = []
    view = threading.Thread(target=lambda: answers.append(s.api.get("/v1/cluster").status_code))
    try:
        view.start()
        assert asking.wait(WAIT_S), "/v1/cluster did not ask the cluster"
        submitted = s.request("cluster view held", "POST", "/v1/runs", json=spec("while-held", steps=5))
        assert submitted.status_code == 201 and not answers, "answered while the cluster view was held"
        s.request("cluster view held", "GET", "/v1/teams")
    finally:
        gate.set()
        view.join(20)
    assert answers == [200]
