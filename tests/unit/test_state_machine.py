"""The run controller driven one step at a time with a fake worker group."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from controller.spec import parse_spec
from controller.state import RunController, RunState, group_errors
from tests.unit.fakes import FakeWorkerGroup

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())


def controller(raw: dict | None = None, group: FakeWorkerGroup | None = None) -> tuple[RunController, FakeWorkerGroup]:
    spec = parse_spec(raw or BASE)
    group = group or FakeWorkerGroup()
    return RunController(spec, spec.topology(), group, now=100.0), group


def test_happy_path_state_by_state() -> None:
    c, g = controller()
    assert c.state is RunState.PENDING
    assert c.step(101.0) is RunState.PLANNING
    assert c.step(102.0) is RunState.LAUNCHING
    assert c.plan is not None and c.plan.mesh.world_size == 8
    assert c.step(103.0) is RunState.RUNNING
    assert len(g.started) == 1 and g.started[0].attempt == 0 and g.started[0].resume_step is None
    g.finish_steps(1, 5)
    assert c.step(104.0) is RunState.RUNNING
    assert c.to_dict(104.0)["step"] == 5
    g.finish_steps(6, 30)
    g.complete()
    assert c.step(120.0) is RunState.SUCCEEDED
    assert g.shutdowns == 1
    assert c.events.kinds() == ["submitted", "planned", "attempt_started", "succeeded"]
    times = [e.time for e in c.events]
    assert times == sorted(times)
    run = c.to_dict(120.0)
    assert run["state"] == "succeeded" and run["finished_at"] == 120.0 and run["error"] is None
    assert [h["step"] for h in run["history"]] == list(range(1, 31))
    assert 0 < run["goodput"]["ettr"] <= 1
    assert {r["rank"] for r in run["placement"]} == set(range(8))
    assert c.step(130.0) is RunState.SUCCEEDED, "terminal states do not move"


def test_worker_error_fails_the_run_with_grouped_reason() -> None:
    c, g = controller()
    for t in (1, 2, 3):
        c.step(100.0 + t)
    g.finish_steps(1, 2)
    g.error_worker(3, "Traceback...\nRuntimeError: CUDA error: an illegal memory access")
    g.error_worker(5, "Traceback...\nRuntimeError: CUDA error: an illegal memory access")
    g.error_worker(6, "ActorDiedError: the actor died unexpectedly")
    assert c.step(110.0) is RunState.FAILED
    assert c.error is not None and c.error.code == "worker_failed"
    assert c.error.message == ("ranks [3, 5]: RuntimeError: CUDA error: an illegal memory access; "
                               "ranks [6]: ActorDiedError: the actor died unexpectedly")
    assert g.shutdowns == 1
    assert c.events.kinds()[-1] == "failed"


@pytest.mark.parametrize("at_state", [RunState.PLANNING, RunState.LAUNCHING, RunState.RUNNING])
def test_cancel_from_any_live_state(at_state: RunState) -> None:
    c, g = controller()
    while c.state is not at_state:
        c.step(101.0)
    c.cancel()
    assert c.step(102.0) is RunState.CANCELLED
    assert g.shutdowns == 1
    assert c.events.kinds()[-1] == "cancelled"


def test_infeasible_plan_fails_before_launch() -> None:
    raw = copy.deepcopy(BASE)
    raw["cluster"]["local"]["spares"] = 2
    c, g = controller(raw)
    c.step(101.0)
    assert c.step(102.0) is RunState.FAILED
    assert c.error is not None and c.error.code == "plan_infeasible"
    assert "dp*pp*tp = 2*2*2 = 8 GPUs but the healthy nodes offer 4" in c.error.message
    assert g.started == []


def test_launch_failure_fails_and_cleans_up() -> None:
    c, g = controller(group=FakeWorkerGroup(fail_start=TimeoutError("placement group not ready in 60 s")))
    for t in (1, 2, 3):
        c.step(100.0 + t)
    assert c.state is RunState.FAILED
    assert c.error is not None and "placement group not ready in 60 s" in c.error.message
    assert g.shutdowns == 1


def test_rank_events_join_the_timeline() -> None:
    c, g = controller()
    for t in (1, 2, 3):
        c.step(100.0 + t)
    g.finish_steps(1, 20)
    g.emit(0, "checkpoint_committed", step=20, seconds=1.5)
    c.step(110.0)
    ev = c.events.of_kind("checkpoint_committed")
    assert len(ev) == 1 and ev[0].detail["step"] == 20 and ev[0].attempt == 0
    assert c.goodput(110.0)["badput_seconds"]["checkpoint"] == 1.5


def test_group_errors_is_stable_for_one_rank() -> None:
    assert group_errors({2: "boom"}) == "ranks [2]: boom"
