"""Preemption without loss, the controller's and the service's side (issue 45), on fake workers: a
higher-priority run that cannot be placed stops the lower-priority runs whose nodes make it fit, the
fewest GPUs, each at a step boundary with that step committed (trainer/stop.py; the trainer's side is
tests/dist/test_stop.py); the stopped run is not failed, goes back to the queue, and starts again
from that step once it fits. (The Ray worker group cannot be asked to stop yet: no preemption there.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.service.registry import sqlite_url
from controller.service.scheduler import Running, preemption_victims
from controller.spec import parse_spec
from controller.topology import Topology
from tests.unit.test_service import Harness, _commit, raw_spec

CLUSTER = Topology.from_local(nodes=5, gpus_per_node=2, racks=2, spares=1)


def running(seq: int, priority: int, *nodes: str) -> Running:
    return Running(seq=seq, priority=priority, gpus=2 * len(nodes), nodes=frozenset(nodes))


def test_the_victims_are_the_fewest_gpus_that_make_it_fit_then_the_lowest_priority_then_the_newest() -> None:
    usable = CLUSTER
    free = Topology(tuple(n for n in usable.nodes if n.name == "node-4"))  # only the spare is free
    spec = parse_spec(raw_spec("hi", dp=1, tp=2))  # 2 GPUs: one node
    runs = [running(1, 0, "node-0", "node-1"), running(2, 0, "node-2"), running(3, 100, "node-3")]
    assert preemption_victims(spec, 200, free, usable, runs) == (2,), "one node's run, of the lowest class"
    assert preemption_victims(spec, 100, free, usable, runs) == (2,), "never a run of its own class or above"
    big = parse_spec(raw_spec("big", dp=2, tp=2))  # 4 GPUs: two nodes
    assert preemption_victims(big, 200, free, usable, runs) == (1,), "one run of 4 before two of 2 + 2"
    assert preemption_victims(big, 100, free, usable, [runs[1], runs[2]]) is None, "no lower class can make room"
    newest = [running(1, 0, "node-0"), running(2, 0, "node-1")]
    assert preemption_victims(spec, 200, free, usable, newest) == (2,), "of two alike, the newest"


def test_a_high_priority_run_preempts_a_low_one_which_resumes_from_the_step_it_stopped_at(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)), store_root=tmp_path / "ckpt")
    s = h.service
    s.add(parse_spec(raw_spec("low", dp=4, tp=2, priority="low")))  # every training GPU
    h.until("low", "running")
    low = s.controller("low")
    h.group("low").finish_steps(1, 7)
    h.tick("low")
    s.add(parse_spec(raw_spec("high", dp=2, tp=2, priority="high")))
    h.tick("low")  # the scheduler asks low to stop; low's controller sends it to its ranks
    h.tick("low")
    assert h.group("low").stop_requests == [("store", "preempted by high (priority high)")]
    assert "preempting low" in s.run("high")["waiting_for"] or "low stopping" in s.run("high")["waiting_for"]
    assert low.events.of_kind("stop_requested")[-1].detail["step"] == 7
    h.group("low").finish_steps(8, 8)
    _commit(tmp_path / "ckpt", "low", 8, at=h.clock.t)  # what the stopped ranks committed (fakes write nothing)
    h.group("low").stop_at(8)  # the ranks stop after step 8 with it committed
    h.tick("low")
    assert s.run("low")["state"] == "pending" and low.failures == [], "not a failure: nothing charged"
    preempted = low.events.of_kind("preempted")[-1].detail
    assert preempted == {"step": 8, "kept": "store", "reason": "preempted by high (priority high)"}
    assert h.groups["low"][0].closed and s.run("low")["waiting_for"], "its GPUs released, back in the queue"
    assert {t["name"]: t["preemptions"] for t in s.teams_view()}["default"] == 1
    h.tick("high")
    assert s.run("high")["state"] in ("launching", "running")
    h.until("high", "running")
    h.group("high").finish_steps(1, 40)
    h.group("high").complete()
    h.until("high", "succeeded")
    h.until("low", "running")
    assert len(h.groups["low"]) == 2 and h.group("low") is h.groups["low"][1], "a fresh worker group"
    started = h.group("low").started[-1]
    assert (started.attempt, started.resume_step, started.start_step) == (1, 8, 8), "from the step it stopped at"
    assert low.failures == [] and s.run("low")["attempt"] == 1
    goodput = low.goodput(h.clock.t)
    (p,) = goodput["preemptions"]
    preempted_at = low.events.of_kind("preempted")[-1].time
    resumed_at = low.events.of_kind("attempt_started")[-1].time
    assert (p["step"], p["at"], p["resumed_at"]) == (8, preempted_at, resumed_at)
    assert p["waited_s"] == resumed_at - preempted_at > 0 and goodput["failures"] == []
    assert goodput["badput_seconds"]["waiting_for_capacity"] >= p["waited_s"], "charged to waiting for capacity"
    assert goodput["productive_seconds"] + sum(goodput["badput_seconds"].values()) == \
        pytest.approx(goodput["wall_seconds"], abs=1e-6)


def test_a_run_that_fails_while_stopping_can_be_asked_again(tmp_path: Path) -> None:
    from controller.attribution import ATTRIBUTION_GRACE_S

    h = Harness(sqlite_url(str(tmp_path)), store_root=tmp_path / "ckpt")
    s = h.service
    s.add(parse_spec(raw_spec("low", dp=4, tp=2, priority="low")))
    h.until("low", "running")
    low = s.controller("low")
    h.group("low").finish_steps(1, 3)
    h.tick("low")
    assert low.preempt("preempted by a test") and not low.preempt("again"), "one stop at a time"
    h.tick("low")
    assert low.stopping and h.group("low").stop_requests
    h.group("low").error_worker(2, "Traceback...\nRuntimeError: CUDA error: an illegal memory access")
    h.tick("low")
    h.tick("low", dt=ATTRIBUTION_GRACE_S + 1)  # the failure, not the stop, ends the attempt
    h.until("low", "running")
    assert not low.stopping and low.attempt == 1, "the next attempt was never asked"
    assert low.preempt("preempted by a test"), "and can be"
