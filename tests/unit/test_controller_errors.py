"""No controller error ends a run (issue 43, item 0): an exception inside the controller is a bug to
report, with its traceback in the service's log and the run's events, and the run goes on by its
failure policy. And the bug found that way: a relaunch that failed because a node died while its
workers started was taken for a lost replica of the attempt before it (`heal_replica`), and the
worker group, which had no workers then, raised IndexError."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.run_state import RunState
from controller.service.registry import Registry, sqlite_url
from controller.service.service import Service
from controller.spec import RunSpec, parse_spec
from controller.state import RunController
from controller.topology import Topology
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup, ManualClock, drive

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = yaml.safe_load((ROOT / "examples" / "tiny-gpt-replicas.yaml").read_text())


class ReplicaGroup(FakeWorkerGroup):
    """A worker group that can go on without a replica, as the Ray one can, with the Ray one's old
    flaw kept on purpose: `contains_replicas` stays true after the attempt ended (the Ray group kept
    the last attempt's membership until a new start got past its workers' start). Its
    `lose_replicas` stops each lost rank's worker, as the Ray one does, so with no workers (a launch
    that never started any) it raises IndexError, as the Ray one did."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: list[str] = []
        self.lost: list[list[int]] = []

    def start(self, attempt: Any) -> None:
        self.workers = []
        super().start(attempt)
        self.workers = [f"rank-{r}" for r in range(attempt.placement.mesh.world_size)]

    def shutdown(self) -> None:
        super().shutdown()
        self.workers = []

    def contains_replicas(self) -> bool:
        return True

    def lose_replicas(self, replicas: list[int], nodes: tuple[str, ...], *, suspect: bool = False) -> None:
        per = len(self.workers) // 2 if self.workers else 4
        for replica in replicas:
            for rank in range(replica * per, (replica + 1) * per):
                self.workers[rank]  # noqa: B018 - the Ray group's `group.actors[rank]`
        self.lost.append(list(replicas))

    def form_replicas(self, replicas: list[int], placement: Any) -> None:
        pass


def replica_controller(group: FakeWorkerGroup) -> tuple[RunController, ManualClock, FakeCluster]:
    raw = copy.deepcopy(REPLICAS)
    raw["drills"] = []
    spec = parse_spec(raw)
    cluster = FakeCluster(spec.topology())
    clock = ManualClock(100.0)
    return RunController(spec, cluster.nodes, group, now=clock.t, topology_source=cluster.topology), clock, cluster


def running(c: RunController, clock: ManualClock) -> None:
    def tick(_: float) -> None:
        clock.t += 1
        c.step(clock.t)

    drive(c, RunState.RUNNING, tick)


def test_a_relaunch_whose_node_died_while_its_workers_started_is_a_failure_of_the_launch_not_a_lost_replica() -> None:
    group = ReplicaGroup()
    c, clock, cluster = replica_controller(group)
    running(c, clock)
    group.finish_steps(1, 10)
    clock.t += 1
    c.step(clock.t)
    # the silent node: no progress until the hang verdict, which stops the world (nodes still healthy)
    clock.t += c.spec.health.hang_floor_s + 60
    c.step(clock.t)
    assert c.state is RunState.LAUNCHING, c.events.kinds()
    assert c.events.of_kind("decision")[-1].detail["action"] == "restart"
    node = group.started[-1].placement.node_of_rank[0]
    cluster.nodes = Topology(tuple(n for n in cluster.nodes.nodes if n.name != node))  # Ray no longer lists it
    group.fail_next_start(RuntimeError(f"node(s) [{node!r}] died while their workers were starting"))
    clock.t += 1
    c.step(clock.t)  # the relaunch: before the fix, heal_replica, then IndexError from lose_replicas
    decision = c.events.of_kind("decision")[-1].detail
    assert decision["action"] != "heal_replica" and not group.lost, decision
    assert c.state is RunState.LAUNCHING and decision["action"] == "replace", decision
    running(c, clock)
    assert node not in group.started[-1].placement.nodes(), "the dead node gets no rank"


class BuggyGroup(FakeWorkerGroup):
    """A worker group whose poll raises once, as a bug in the controller's Ray edge would."""

    def __init__(self) -> None:
        super().__init__()
        self.bug: Exception | None = None

    def poll(self) -> Any:
        if self.bug is not None:
            bug, self.bug = self.bug, None
            raise bug
        return super().poll()


def test_an_exception_inside_the_controller_is_logged_with_its_traceback_and_the_run_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    groups: list[BuggyGroup] = []

    def group(spec: RunSpec, run_id: str) -> BuggyGroup:
        groups.append(BuggyGroup())
        return groups[-1]

    clock = ManualClock(1000.0)
    service = Service(Registry(sqlite_url(str(tmp_path))), FakeCluster(Topology.from_local(nodes=5, gpus_per_node=2,
                                                                                           racks=2, spares=1)),
                      group_factory=group, injector_factory=lambda g: FakeInjector(g),  # type: ignore[arg-type]
                      clock=clock, threads=False)
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    raw.update(name="buggy", drills=[])
    run_id = service.submit(raw)["id"]

    def tick() -> str:
        clock.t += 1
        service.schedule()
        service.advance(run_id)
        return service.run(run_id)["state"]

    while tick() != "running":
        pass
    g = service.controller(run_id).worker_group
    assert isinstance(g, BuggyGroup)
    g.finish_steps(1, 5)
    tick()
    g.bug = IndexError("list index out of range")
    assert tick() == "launching", "the run goes on: a restart, by the failure policy"
    assert "IndexError: list index out of range" in capsys.readouterr().err
    assert "Traceback (most recent call last)" in service.controller(run_id).events.of_kind("controller_error")[0] \
        .detail["traceback"]
    events = service.controller(run_id).events
    assert events.of_kind("failure_detected")[-1].detail["cause"] == "controller_error"
    assert events.of_kind("decision")[-1].detail["action"] == "restart"
    while tick() != "running":
        pass
    assert g.started[-1].attempt == 1
    g.finish_steps(6, 30)
    g.complete()
    assert tick() == "succeeded"


def test_a_controller_error_that_repeats_ends_the_run_by_its_failure_budget(tmp_path: Path) -> None:
    group = BuggyGroup()
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    raw.update(name="always-buggy", drills=[])
    raw["elastic"] = {**raw.get("elastic", {}), "max_failures": 2}
    spec = parse_spec(raw)
    c = RunController(spec, spec.topology(), group, now=100.0)
    t = 100.0
    while c.state is not RunState.FAILED:
        t += 1
        if c.state is RunState.RUNNING:
            group.bug = IndexError("list index out of range")
            try:
                c.step(t)
            except IndexError as e:
                c.controller_error(t, e, "Traceback (most recent call last): ...")
        else:
            c.step(t)
        assert t < 200
    assert c.error is not None and c.error.code == "failure_budget", c.error
    assert len(c.events.of_kind("controller_error")) == 3
