"""`goodput serve` from a user's point of view, one service for the module (its own embedded cluster:
4 nodes of 2 GPU slots, one of them a hot spare): submit, a kill-node drill recovered onto the spare,
two runs that together need more GPUs than there are (one waits, then both succeed), and the service
SIGKILLed mid-run and started again on the same state dir and registry, a real PostgreSQL server (every
run still listed, the unfinished one
goes on from its latest checkpoint as a new attempt and succeeds). Everything through the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.support.postgres import PostgresServer, unavailable
from tests.support.serve import Serve, _running, wait_for, write_spec

pytestmark = pytest.mark.cluster




@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """The service keeps its registry on a real PostgreSQL server (`--db postgresql+psycopg://...`, the
    prod overlay's kind of registry) where one can be started, else in SQLite under its state dir."""
    root = tmp_path_factory.mktemp("serve")
    why = unavailable()
    if why is not None and os.environ.get("CI"):
        pytest.fail(f"CI must run goodput serve on PostgreSQL: {why}")
    postgres = PostgresServer() if why is None else None
    db = ("--db", postgres.url) if postgres is not None else ()
    serve = Serve(root / "state", root / "serve.log", "--local-nodes", "4", "--gpus-per-node", "2", "--racks", "1",
                  "--spares", "1", *db).start()
    try:
        yield serve
    finally:
        serve.stop()
        if postgres is not None:
            postgres.stop()


WATCHED_STEPS = 100
"""svc-a and its bystander: the drill strikes svc-a at step ~20, then ~80 steps show it trains on to
its end (200 trained ~65 s past the recovery, here) while the bystander, at step ~40 then, is left alone."""


def test_submit_drill_and_watch_a_run_to_the_end(service: Serve, tmp_path: Path) -> None:
    submitted = service.json("submit", str(write_spec(tmp_path / "a.yaml", "svc-a", steps=WATCHED_STEPS, dp=2)))
    assert isinstance(submitted, dict) and submitted["id"] == "svc-a"
    service.cli("submit", str(write_spec(tmp_path / "by.yaml", "svc-bystander", steps=WATCHED_STEPS, dp=2)))
    wait_for(service, "svc-a", lambda s: s["step"] >= 12)
    wait_for(service, "svc-bystander", lambda s: s["step"] >= 1)
    report = service.json("drill", "svc-a", "kill-node")
    assert isinstance(report, dict)
    assert report["outcome"] == "recovered" and report["decision"] == "replace", report
    final = wait_for(service, "svc-a", lambda s: s["state"] == "succeeded")
    assert final["step"] == WATCHED_STEPS and final["attempt"] == 1
    events = service.json("events", "svc-a")
    assert isinstance(events, list)
    kinds = [e["kind"] for e in events]
    injected = next(e for e in events if e["kind"] == "drill_injected")
    detected = next(e for e in events if e["kind"] == "failure_detected")
    decision = next(e for e in events if e["kind"] == "decision")
    assert injected["detail"]["id"] == report["id"] and detected["detail"]["nodes"] == [report["target"]]
    assert decision["detail"]["action"] == report["decision"] == "replace"
    assert report["detection_s"] == pytest.approx(detected["time"] - injected["time"], abs=0.01)
    assert kinds[-1] == "succeeded"
    bystander = wait_for(service, "svc-bystander", lambda s: s["state"] == "succeeded")
    by_events = service.json("events", "svc-bystander")
    assert isinstance(by_events, list) and bystander["attempt"] == 0, "another run's drill left this one alone"
    assert not [e for e in by_events if e["kind"] in ("failure_detected", "decision")]
    assert not {r["node"] for r in bystander["placement"]} & {report["target"]}
    attempts = service.json("checkpoints", "svc-a")
    assert isinstance(attempts, list)
    assert [c["step"] for c in attempts] == list(range(WATCHED_STEPS - 20, WATCHED_STEPS + 1, 10))
    table = service.cli("list").stdout
    assert re.search(rf"svc-a\s+succeeded\s+{WATCHED_STEPS}/{WATCHED_STEPS}", table), table
    cluster = service.cli("status", "svc-a").stdout
    assert f"svc-a: succeeded, step {WATCHED_STEPS}" in cluster
    # goodput export RUN: the spec from the service, the checkpoint straight from its store; the same
    # weights as exporting through the spec file
    by_run = service.cli("export", "svc-a", "--hf", str(tmp_path / "by-run"), "--dtype", "float32").stdout
    assert f"step {WATCHED_STEPS} of run 'svc-a'" in by_run, by_run
    service.cli("export", str(tmp_path / "a.yaml"), "--hf", str(tmp_path / "by-file"), "--dtype", "float32")
    assert (tmp_path / "by-run" / "model.safetensors").read_bytes() == \
        (tmp_path / "by-file" / "model.safetensors").read_bytes()
    missing = service.cli("export", "svc-nope", "--hf", str(tmp_path / "none"), ok=False)
    assert missing.returncode != 0 and "svc-nope" in missing.stderr, missing.stderr


def test_two_runs_that_do_not_fit_together_queue_and_both_succeed(service: Serve, tmp_path: Path) -> None:
    service.cli("submit", str(write_spec(tmp_path / "b.yaml", "svc-b", steps=30, dp=2, tp=2)))
    waiting = service.json("submit", str(write_spec(tmp_path / "c.yaml", "svc-c", steps=30, dp=2, tp=2)))
    assert isinstance(waiting, dict)
    c = wait_for(service, "svc-c", lambda s: s["waiting_for"] is not None, timeout_s=30)
    assert c["state"] == "pending" and "waiting for capacity" in c["waiting_for"], c
    b = wait_for(service, "svc-b", lambda s: s["state"] == "succeeded")
    watched = service.cli("status", "svc-c", "--watch")  # the progress bar until it ends
    assert "svc-c: succeeded, step 30" in watched.stdout and "attempt 0 started" in watched.stderr, watched
    c = wait_for(service, "svc-c", lambda s: s["state"] == "succeeded")
    events = service.json("events", "svc-c")
    assert isinstance(events, list)
    started = next(e["time"] for e in events if e["kind"] == "attempt_started")
    assert started >= b["finished_at"], "the second run started once the first freed its GPUs"
    assert c["step"] == 30


def test_service_killed_mid_run_comes_back_and_carries_the_run_on(service: Serve, tmp_path: Path) -> None:
    service.cli("submit", str(write_spec(tmp_path / "d.yaml", "svc-d", steps=150, dp=2)))
    wait_for(service, "svc-d", lambda s: s["step"] >= 24)
    before = service.json("list")
    assert isinstance(before, list)
    children = service.descendants()
    recorded = (service.state / "embedded-cluster.pids").read_text().splitlines()
    folders = [Path(row[4:]) for row in recorded if row.startswith("dir ")]
    assert len(folders) == 2 and all(f.is_dir() for f in folders), recorded  # Ray's session, the peer snapshots
    assert service.proc is not None
    service.proc.send_signal(signal.SIGKILL)
    service.proc.wait()
    service.start()  # on the same state dir: it ends what the killed one left running
    assert not any(f.exists() for f in folders), "the killed service's cluster folders are removed"
    _, alive = psutil.wait_procs(children, timeout=30)
    left = [p for p in alive if _running(p)]
    for p in left:  # the test started them too: ended by PID if the service did not
        p.kill()
    assert not left, f"the killed service's {[(p.pid, p.name()) for p in left]} still run after the restart"
    after = service.json("list")
    assert isinstance(after, list)
    assert [r["id"] for r in after] == [r["id"] for r in before], "every run submitted before the restart"
    d = wait_for(service, "svc-d", lambda s: s["state"] == "succeeded")
    events = service.json("events", "svc-d")
    assert isinstance(events, list)
    restarted = [e for e in events if e["kind"] == "service_restarted"]
    assert len(restarted) == 1
    new_attempt = [e for e in events if e["kind"] == "attempt_started"][-1]
    assert new_attempt["attempt"] == 1 and new_attempt["detail"]["start_step"] >= 20
    assert d["step"] == 150
    committed = service.json("checkpoints", "svc-d")
    assert isinstance(committed, list) and committed[-1]["step"] == 150
    token = (service.state / "api-token").read_text().strip()
    assert stat.S_IMODE(os.stat(service.state / "api-token").st_mode) == 0o600
    if not unavailable():
        assert "registry postgresql+psycopg://" in service.text(), "the restarted service is on PostgreSQL"
    assert token not in service.text(), "the token is never logged"
    assert "api-token" in service.text(), "where it is kept is"
    for run in [r["id"] for r in after]:  # every run this service has (the module's other tests' too)
        assert token not in json.dumps(service.json("events", run))


def _with(path: Path, **top: object) -> Path:
    import yaml

    spec = yaml.safe_load(path.read_text())
    spec.update(top)
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_high_priority_run_preempts_a_low_one_which_resumes_and_ends_bit_identical(service: Serve,
                                                                                       tmp_path: Path) -> None:
    """Two teams, three runs (issue 45): nlp's low-priority run and its normal one fill the 6 training
    GPUs; vision's high-priority run needs 4. The low one (the fewest GPUs that make room) stops after a
    step with it committed, waits in the queue, starts again from that step once the high one is done,
    and ends with the same weights as the same spec never preempted; nothing is charged as a failure."""
    for team in ("vision", "nlp"):
        service.cli("teams", "create", team)

    def token(name: str, team: str) -> str:
        out = service.cli("tokens", "create", name, "--team", team, "--role", "submitter").stdout
        return next(line for line in out.splitlines() if line.startswith("gp_"))

    def as_team(tok: str, *args: str) -> str:
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-m", "controller", *args], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "GOODPUT_URL": service.url, "GOODPUT_TOKEN": tok})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    nlp, vision = token("nia", "nlp"), token("vic", "vision")
    spec = lambda name, steps, dp, **top: str(_with(write_spec(tmp_path / f"{name}.yaml", name, steps=steps,  # noqa: E731
                                                               dp=dp, tp=2, every_steps=10), **top))
    as_team(nlp, "submit", spec("svc-low", 30, 2, priority="low"))
    as_team(nlp, "submit", spec("svc-mid", 12, 1))
    wait_for(service, "svc-low", lambda s: s["step"] >= 4)
    as_team(vision, "submit", spec("svc-high", 12, 2, priority="high"))
    high = wait_for(service, "svc-high", lambda s: s["state"] == "succeeded", timeout_s=600)
    low = wait_for(service, "svc-low", lambda s: s["state"] == "succeeded", timeout_s=600)
    events = service.json("events", "svc-low")
    assert isinstance(events, list)
    (preempted,) = [e for e in events if e["kind"] == "preempted"]
    assert preempted["detail"]["reason"] == "preempted by svc-high (priority high)", preempted
    assert not [e for e in events if e["kind"] == "failure_detected"], "a preemption is not a failure"
    attempts = [e for e in events if e["kind"] == "attempt_started"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert attempts[1]["detail"]["resume_step"] == preempted["detail"]["step"], "0 steps redone"
    assert attempts[1]["time"] >= high["finished_at"] - 60 and low["goodput"]["preemptions"], low["goodput"]
    assert service.json("status", "svc-mid")["attempt"] == 0, "the normal run, 2 GPUs, was not needed"  # type: ignore[index]
    # The reference: the same spec, never preempted (admin token: the default team), alone.
    service.cli("submit", spec("svc-ref", 30, 2, priority="low"))
    wait_for(service, "svc-ref", lambda s: s["state"] == "succeeded", timeout_s=600)
    for run in ("svc-low", "svc-ref"):
        service.cli("export", run, "--hf", str(tmp_path / run), "--dtype", "float32")
    assert (tmp_path / "svc-low" / "model.safetensors").read_bytes() == \
        (tmp_path / "svc-ref" / "model.safetensors").read_bytes(), "the same weights as never preempted"
    teams = {t["name"]: t for t in service.json("teams")}  # type: ignore[union-attr]
    assert teams["nlp"]["preemptions"] == 1 and teams["vision"]["preemptions"] == 0


def test_a_drained_node_is_left_at_a_step_boundary_from_peers_memory_and_the_run_ends_bit_identical(
        service: Serve, tmp_path: Path) -> None:
    """`goodput nodes drain NODE --by 10m` on a node of a training run (issue 45): the ranks stop after
    their next peer snapshot step, the node's ranks go to the spare and load that step from their
    buddies' memory (0 bytes from the store, 0 steps redone, nothing charged); the node is `drained`
    until `goodput nodes release`, and the run ends with the same weights as the same spec never
    drained."""
    spec = lambda name: str(write_spec(tmp_path / f"{name}.yaml", name, steps=40, dp=2, tp=2,  # noqa: E731
                                       every_steps=25))
    service.cli("submit", spec("svc-drain"))
    status = wait_for(service, "svc-drain", lambda s: s["step"] >= 5)
    node = sorted({row["node"] for row in status["placement"]})[-1]
    out = service.cli("nodes", "drain", node, "--by", "10m").stdout
    assert "draining" in out and "svc-drain" in out, out
    final = wait_for(service, "svc-drain", lambda s: s["state"] == "succeeded", timeout_s=600)
    events = service.json("events", "svc-drain")
    assert isinstance(events, list)
    kinds = [e["kind"] for e in events]
    assert "failure_detected" not in kinds and final["attempt"] == 1, "a drain is not a failure"
    (asked,) = [e for e in events if e["kind"] == "stop_requested"]
    (drained,) = [e for e in events if e["kind"] == "drained"]
    assert asked["detail"]["keep"] == "peers" and drained["detail"]["nodes"] == [node], drained
    assert drained["detail"]["kept"] == "peers", drained
    step = drained["detail"]["step"]
    # The controller's `stop_requested` step is the last it had heard of, which lags the ranks by a step
    # or more on a loaded machine; the ranks say after which step they agreed on the stop.
    (stopped,) = [e for e in events if e["kind"] == "stopped_at_boundary"]
    assert asked["detail"]["step"] <= stopped["detail"]["agreed_step"], "not agreed before it was asked"
    assert step == stopped["detail"]["step"] == stopped["detail"]["agreed_step"], \
        "stopped at the step it was agreed after (a peer snapshot every step)"
    (started,) = [e for e in events if e["kind"] == "attempt_started" and e["attempt"] == 1]
    assert (started["detail"]["start_step"], started["detail"]["restore_from"]) == (step, "peer"), "0 steps redone"
    restored = [e for e in events if e["kind"] == "restored" and e["attempt"] == 1]
    assert restored and {e["detail"]["source"] for e in restored} == {"peer"}, restored
    assert sum(e["detail"]["bytes_read"] for e in restored) == 0, "0 bytes from the store"
    assert node not in {row["node"] for row in final["placement"]}
    nodes = {n["name"]: n for n in service.json("nodes")["nodes"]}  # type: ignore[index]
    assert nodes[node]["state"] == "drained", nodes[node]
    assert final["goodput"]["failures"] == [] and final["goodput"]["badput_seconds"]["recomputation"] == 0
    service.cli("nodes", "release", node)
    assert {n["name"]: n for n in service.json("nodes")["nodes"]}[node]["state"] in ("spare", "healthy")  # type: ignore[index]
    service.cli("submit", spec("svc-drain-ref"))
    wait_for(service, "svc-drain-ref", lambda s: s["state"] == "succeeded", timeout_s=600)
    for run in ("svc-drain", "svc-drain-ref"):
        service.cli("export", run, "--hf", str(tmp_path / run), "--dtype", "float32")
    assert (tmp_path / "svc-drain" / "model.safetensors").read_bytes() == \
        (tmp_path / "svc-drain-ref" / "model.safetensors").read_bytes(), "the same weights as never drained"


def test_a_spot_reclaim_is_left_within_its_grace_period_from_peers_memory(service: Serve, tmp_path: Path) -> None:
    """The spot-reclaim drill SIGTERMs a node's training processes and kills the node 30 s later (a spot
    VM's notice): the ranks catch it, stop together at their next peer snapshot step, and the node's
    ranks go on elsewhere from that step before the node dies; nothing redone, nothing charged."""
    service.cli("submit", str(write_spec(tmp_path / "spot.yaml", "svc-spot", steps=40, dp=2, tp=2, every_steps=25)))
    status = wait_for(service, "svc-spot", lambda s: s["step"] >= 5)
    node = sorted({row["node"] for row in status["placement"]})[-1]
    report = service.json("drill", "svc-spot", "spot-reclaim", "--target", node, "--seconds", "30")
    assert isinstance(report, dict) and report["outcome"] == "recovered", report
    assert (report["cause"], report["decision"], report["steps_lost"]) == ("drained", "replace", 0), report
    assert report["restored_from"] == "peer" and report["drained_at"] < report["injected_at"] + 30, report
    final = wait_for(service, "svc-spot", lambda s: s["state"] == "succeeded", timeout_s=600)
    events = service.json("events", "svc-spot")
    assert isinstance(events, list)
    assert not [e for e in events if e["kind"] == "failure_detected"], "left before the node died: no failure"
    assert [e["detail"]["reason"] for e in events if e["kind"] == "drained"] == [f"SIGTERM on {node}"]
    assert node not in {row["node"] for row in final["placement"]} and final["goodput"]["failures"] == []
