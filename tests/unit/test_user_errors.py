"""A user's bug is not a dead node (issue 45): the same exception from the model, data or provider code
at the same step again after a restart on other nodes ends the run as `user_error` after that one
retry, with the traceback in the Run object and the events; anything else stays an infrastructure
failure under elastic.max_failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from controller.attribution import ATTRIBUTION_GRACE_S
from controller.failure_policy import FailureCause, FailureEvent
from controller.run_state import RunState
from controller.spec import parse_spec
from controller.state import RunController
from controller.topology import NodeState
from controller.user_errors import Judgement, Raised, judge, raised, signature
from tests.unit.fakes import FakeWorkerGroup, drive

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
TRACE = ('ValueError: shapes (4, 96) and (128, 4) do not align\nTraceback (most recent call last):\n'
         '  File "/home/ana/model.py", line 41, in forward\n    return x @ self.w\n'
         'ValueError: shapes (4, 96) and (128, 4) do not align')


def test_the_signature_is_the_exception_line_without_addresses() -> None:
    assert signature(TRACE) == "ValueError: shapes (4, 96) and (128, 4) do not align"
    assert signature("Traceback...\nKeyError: <object at 0x7f3a2b>\n") == "KeyError: <object at 0x?>"


def seen(sig: str, step: int, *nodes: str) -> Raised:
    return Raised(signature=sig, step=step, nodes=frozenset(nodes), ranks=(3,), traceback=sig)


def test_the_judgement() -> None:
    first = seen("E: x", 7, "node-1")
    assert judge(None, first) is Judgement.FIRST
    assert judge(first, seen("E: x", 7, "node-4")) is Judgement.USER_ERROR, "the same, elsewhere"
    assert judge(first, seen("E: x", 7, "node-1")) is Judgement.SAME_NODES, "a node could still be the cause"
    assert judge(first, seen("E: y", 7, "node-4")) is Judgement.FIRST, "another exception"
    assert judge(first, seen("E: x", 8, "node-4")) is Judgement.FIRST, "another step"
    both = seen("E: x", 7, "node-1", "node-2")
    assert judge(both, both) is Judgement.USER_ERROR, "raised on two nodes: no one node makes another raise it"
    event = FailureEvent(time=1.0, cause=FailureCause.WORKER_ERROR, ranks=(3,), evidence={"errors": {"3": TRACE}})
    got = raised(event, step=7, node_of_rank=("a",) * 2 + ("b",) * 2)
    assert got is not None and got.nodes == frozenset({"b"}) and got.traceback == TRACE and got.step == 7
    assert raised(FailureEvent(time=1.0, cause=FailureCause.NODE_LOST), step=7, node_of_rank=()) is None


def fail_at(c: RunController, g: FakeWorkerGroup, t: float, step: int, rank: int, text: str) -> float:
    """The run trains to `step - 1` and rank `rank` raises `text` in step `step`; returns the time after detection."""
    done = c.progress.step
    if step - 1 > done:
        g.finish_steps(done + 1, step - 1)
    c.step(t)
    g.error_worker(rank, text)
    c.step(t + 0.1)
    c.step(t + 0.2 + ATTRIBUTION_GRACE_S)
    return t + 1 + ATTRIBUTION_GRACE_S


def test_the_same_exception_at_the_same_step_on_other_nodes_ends_the_run_as_a_user_error() -> None:
    spec = parse_spec(BASE)
    g = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), g, now=100.0)
    drive(c, RunState.RUNNING)
    node = c.placement.node_of_rank[7] if c.placement else ""
    t = fail_at(c, g, 110.0, 12, 7, TRACE)
    decision = c.events.of_kind("decision")[-1].detail
    assert decision["code"] == "retried_elsewhere" and node in decision["reason"], decision
    assert c.state is RunState.LAUNCHING
    assert c.placement is not None and node not in c.placement.nodes(), "rank 7's node left out of the retry"
    assert node in c.topology.names_in(NodeState.HEALTHY), "not accused: still healthy"
    t = drive(c, RunState.RUNNING, t=t)
    t = fail_at(c, g, t, 12, 7, TRACE)  # resumed from its checkpoint, the same step raises the same again
    assert c.state is RunState.FAILED and c.error is not None and c.error.code == "user_error"
    assert "ValueError: shapes (4, 96) and (128, 4) do not align" in c.error.message and "step 12" in c.error.message
    run = c.to_dict(t)
    assert run["error"]["code"] == "user_error" and run["error"]["traceback"] == TRACE
    failed = c.events.of_kind("failed")[-1].detail
    assert failed["code"] == "user_error" and 'File "/home/ana/model.py", line 41' in failed["traceback"]
    assert c.failures == [], "ended after one retry, max_failures untouched: the user's code, not the cluster"
    assert run["budgets"]["infrastructure"]["used"] == 0 and run["budgets"]["user_error"]["retried"]


def test_another_exception_or_another_step_is_retried_as_the_cluster_s() -> None:
    spec = parse_spec(BASE)
    g = FakeWorkerGroup()
    c = RunController(spec, spec.topology(), g, now=100.0)
    drive(c, RunState.RUNNING)
    t = fail_at(c, g, 110.0, 12, 7, TRACE)
    t = drive(c, RunState.RUNNING, t=t)
    t = fail_at(c, g, t, 13, 7, TRACE)  # the same exception at another step: a flaky cause, retried
    assert c.state is RunState.LAUNCHING
    t = drive(c, RunState.RUNNING, t=t)
    t = fail_at(c, g, t, 13, 7, "Traceback...\nRuntimeError: CUDA error: an illegal memory access")
    assert c.state is RunState.LAUNCHING and c.error is None


def test_goodput_status_shows_the_users_traceback(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from controller.cli.main import main
    from controller.service.app import create_app, serve
    from tests.unit.test_roles import Shared

    shared = Shared()
    c, g = shared.controller, shared.group
    t = shared.clock.t
    for _ in range(2):  # raised, retried elsewhere, raised again at the same step
        if c.progress.step < 11:
            g.finish_steps(c.progress.step + 1, 11)
        shared.step(t)
        g.error_worker(7, TRACE)
        for dt in (0.1, 0.2 + ATTRIBUTION_GRACE_S, 1 + ATTRIBUTION_GRACE_S):
            shared.step(t + dt)
        t = drive(c, RunState.RUNNING, shared.step, t=t + 2 + ATTRIBUTION_GRACE_S) if not c.state.terminal else t
    assert c.state is RunState.FAILED
    server = serve(create_app(shared.service, token="service-admin-token"), "127.0.0.1", 0)
    try:
        monkeypatch.setenv("GOODPUT_URL", server.url)
        monkeypatch.setenv("GOODPUT_TOKEN", "service-admin-token")
        with pytest.raises(SystemExit):
            main(["status", "tiny-gpt"])
        out = capsys.readouterr().out
        assert "tiny-gpt: failed" in out and "user error: ValueError: shapes (4, 96) and (128, 4) do not align" in out
        assert '  File "/home/ana/model.py", line 41, in forward' in out
    finally:
        server.stop()
