"""What a newcomer meets right after `make run`, following the README's "The service": the service's
defaults hold the README's example; a submission never finishes another run's checkpoints; a relative
checkpoint URI lands under the service's state dir."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

from checkpointing.manifest import Manifest, commit
from checkpointing.store import LocalStore, anchored
from controller.cli.main import build_parser
from controller.run_state import RunState
from controller.service.registry import Registry
from controller.service.service import Service
from controller.service.main import EMBEDDED_CLUSTER
from controller.spec import parse_spec
from controller.planner import plan_run
from controller.topology import Topology
from tests.unit.fakes import FakeCluster, FakeWorkerGroup, FlakyStore, ManualClock
from trainer.config import state_fingerprint, state_identity

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())


def test_serve_defaults_are_make_runs_cluster_and_hold_the_example() -> None:
    opts = build_parser().parse_args(["serve"])
    serve = {"nodes": opts.local_nodes, "gpus_per_node": opts.gpus_per_node, "racks": opts.racks,
             "spares": opts.spares}
    assert serve == EMBEDDED_CLUSTER == {k: EXAMPLE["cluster"]["local"][k] for k in EMBEDDED_CLUSTER}
    spec = parse_spec(EXAMPLE)
    served = Topology.from_local(**EMBEDDED_CLUSTER)
    plan, placement = plan_run(spec, served)
    assert plan.mesh.world_size == 8 and len(placement.spares) == 1


def _make_runs_checkpoint(store: LocalStore, run_id: str, step: int, *, at: float) -> None:
    """What `make run` leaves: a committed step of the example's own model under its name."""
    model = parse_spec(EXAMPLE).to_model_config()
    commit(store, Manifest(run_id=run_id, step=step, attempt=1, mesh={"dp": 1, "pp": 2, "tp": 2}, world_size=4,
                           cursor=step * 16, seeds={"data": 0, "init": 0}, created_at=at,
                           identity=state_fingerprint(model), identity_detail=state_identity(model)))


def _service(store: object, registry: Registry | None = None) -> Service:
    spec = parse_spec(EXAMPLE)
    return Service(registry or Registry("sqlite://"), FakeCluster(spec.topology()),
                   group_factory=lambda *_: FakeWorkerGroup(), store_factory=lambda _: store, threads=False,
                   clock=lambda: 1000.0)


def test_a_submission_over_make_runs_checkpoints_is_a_new_run_with_an_empty_prefix(tmp_path: Path) -> None:
    """Before: the submission took the id tiny-gpt, found make run's step 60 and "succeeded" at once
    with nothing trained. Now it gets tiny-gpt-2 (the store is asked, not only the registry), trains
    from step 0, says why in its timeline, and make run's checkpoint is untouched."""
    store = LocalStore(tmp_path)
    _make_runs_checkpoint(store, "tiny-gpt", 60, at=500.0)
    before = {o.key: o.size for o in store.list("tiny-gpt/")}
    service = _service(store)
    run = service.submit(EXAMPLE)
    assert run["id"] == "tiny-gpt-2"
    chosen = service.controller("tiny-gpt-2").events.of_kind("run_id_chosen")
    assert chosen[0].detail["occupied"] == {"tiny-gpt": [60]} and "goodput resume" in chosen[0].detail["reason"]
    service.schedule()
    group = service.controller("tiny-gpt-2").worker_group
    while not group.started:  # type: ignore[attr-defined]
        service.advance("tiny-gpt-2")
    assert group.started[0].start_step == 0 and group.started[0].resume_step is None  # type: ignore[attr-defined]
    assert {o.key: o.size for o in store.list("tiny-gpt/")} == before
    assert service.submit(EXAMPLE)["id"] == "tiny-gpt-3", "the registry's own ids are skipped too"


def test_a_new_run_refuses_at_launch_checkpoints_it_could_not_see_at_submission(tmp_path: Path) -> None:
    """The store did not answer within the submission's 0.5 s, so the id was taken blind; at launch the
    run finds a checkpoint committed before it was submitted: it fails saying so and how to resume it
    on purpose, and `goodput resume` then does continue from it."""
    slow = FlakyStore(LocalStore(tmp_path / "store"))
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    service = _service(slow, registry=Registry(db))
    slow.delay_s = 1.0
    run = service.submit(EXAMPLE)
    assert run["id"] == "tiny-gpt"
    slow.delay_s = 0.0
    _make_runs_checkpoint(slow.inner, "tiny-gpt", 60, at=500.0)  # before the run's created_at (1000)
    service = _service(slow, registry=Registry(db)).start()  # a restart in between: the guard holds across it
    service.schedule()
    for _ in range(10):
        service.advance("tiny-gpt")
    c = service.controller("tiny-gpt")
    assert c.state is RunState.FAILED and c.error is not None and c.error.code == "checkpoints_in_the_way"
    assert "step 60" in c.error.message and "goodput resume tiny-gpt" in c.error.message
    assert not c.worker_group.started  # type: ignore[attr-defined]
    service.resume("tiny-gpt", step=None, steps=None)
    service.schedule()
    while not c.worker_group.started:  # type: ignore[attr-defined]
        service.advance("tiny-gpt")
    assert c.worker_group.started[0].resume_step == 60  # type: ignore[attr-defined]


def test_a_relative_checkpoint_uri_lands_under_the_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """file://./goodput-runs, the example's, resolves against the service's state dir, not against the
    directory the service happened to be started in; the Run object says where."""
    from controller.spec import checkpoint_store

    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    state = tmp_path / "state"
    spec = parse_spec(EXAMPLE)
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: FakeWorkerGroup(),
                      store_factory=functools.partial(checkpoint_store, probe=False), threads=False,
                      relative_root=state)
    run = service.submit(EXAMPLE)
    assert run["checkpoint_uri"] == f"file://{state / 'goodput-runs'}"
    assert service.controller(run["id"]).spec.checkpoint.uri == f"file://{state / 'goodput-runs'}"
    s3 = {**EXAMPLE, "name": "other", "checkpoint": {**EXAMPLE["checkpoint"], "uri": "s3://bucket/runs"}}
    assert anchored(s3["checkpoint"]["uri"], state) == "s3://bucket/runs"
    assert anchored("/abs/runs", state) == "/abs/runs" and anchored("runs", state) == f"file://{state / 'runs'}"


def test_the_live_view_speaks_in_sentences() -> None:
    """Every event kind the controller and the service emit reads as a sentence: no raw dict, and Unix
    times as clock times (before: drill_requested {'drill': ..., 'requested_at': 1795455311.08})."""
    import re

    from controller.cli.render import describe as _describe

    at = 1795455311.08
    events = [
        {"kind": "drill_requested", "attempt": 0, "detail": {"id": "d-1", "drill": "kill-node", "target": "node-1",
                                                            "at_step": None, "requested_at": at}},
        {"kind": "run_id_chosen", "attempt": 0, "detail": {"run_id": "tiny-gpt-2", "reason": "tiny-gpt holds checkpoints"}},
        {"kind": "node_returned", "attempt": 0, "detail": {"node": "node-1", "lost_at": at, "down_s": 5.123456}},
        {"kind": "store_unavailable", "attempt": 0, "detail": {"error": "down", "since": at, "retry_in_s": 4.0}},
    ]
    for event in events:
        line = _describe(event)
        assert "{" not in line and "1795455311" not in line and "5.123456" not in line, line
    assert _describe(events[0]) == "drill kill-node on node-1 requested (d-1), at the next step"
    assert re.search(r"lost_at \d\d:\d\d:\d\d, down_s 5.12", _describe(events[2]))


def test_cancel_of_an_ended_run_says_it_had_ended(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from controller.service.app import ApiServer, create_app

    spec = parse_spec(EXAMPLE)
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: FakeWorkerGroup(),
                      threads=False)
    run_id = service.submit(EXAMPLE)["id"]
    service.controller(run_id).fail(1.0, "no_capacity", "test")
    service.advance(run_id)  # saves the Run object the API answers from
    server = ApiServer(create_app(service, token="t"), "127.0.0.1", 0).start()
    try:
        env = {**os.environ, "GOODPUT_URL": server.url, "GOODPUT_TOKEN": "t"}
        done = subprocess.run([sys.executable, "-m", "controller", "cancel", run_id], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode != 0 and "had already ended (failed)" in done.stderr and "goodput resume" in done.stderr
        env = {**os.environ, "GOODPUT_URL": server.url, "GOODPUT_STATE_DIR": str(tmp_path / "nowhere")}
        env.pop("GOODPUT_TOKEN", None)
        refused = subprocess.run([sys.executable, "-m", "controller", "list"], capture_output=True, text=True,
                                 timeout=60, env=env)
        assert "GOODPUT_STATE_DIR" in refused.stderr and str(tmp_path / "nowhere") in refused.stderr
    finally:
        server.stop()


def test_a_lost_node_is_listed_its_spare_promoted_and_the_repaired_node_refills_the_pool() -> None:
    """Before: after a kill-node drill the killed node vanished from `goodput nodes`, the spare that
    had replaced it was a spare again once the run ended, and the next 8-GPU run failed no_capacity
    ("the healthy nodes offer 6"). Now: the node is listed lost; the spare that trains in its place is
    promoted (the pool shrinks); the next run fits; the node back from repair refills the pool."""
    full = Topology.from_local(**EMBEDDED_CLUSTER)  # node-0..3 train, node-4 is the spare
    cluster = FakeCluster(full)
    clock = ManualClock(1000.0)
    registry = Registry("sqlite://")
    service = Service(registry, cluster, group_factory=lambda *_: FakeWorkerGroup(), clock=clock, threads=False)

    def tick(*run_ids: str) -> None:
        clock.t += 1.0
        service.schedule()
        for run_id in run_ids:
            if service.run(run_id)["state"] not in ("pending", "succeeded", "failed", "cancelled"):
                service.advance(run_id)

    first = service.submit({**EXAMPLE, "drills": []})["id"]
    for _ in range(4):
        tick(first)
    group = service.controller(first).worker_group
    assert service.run(first)["state"] == "running"
    assert "node-4" not in {r["node"] for r in service.run(first)["placement"]}
    cluster.nodes = Topology(tuple(n for n in full.nodes if n.name != "node-1"))  # its raylet is SIGKILLed
    group.lose_node("node-1")  # type: ignore[attr-defined]
    for _ in range(4):
        tick(first)
    assert "node-4" in {r["node"] for r in service.run(first)["placement"]}, "the spare took node-1's place"
    nodes = {n["name"]: n for n in service.cluster_view()["nodes"]}
    assert nodes["node-1"]["state"] == "lost" and nodes["node-1"]["since"] is not None
    assert nodes["node-4"]["state"] == "healthy", "a spare that trains is a spare no longer"
    group.complete()  # type: ignore[attr-defined]
    for _ in range(3):
        tick(first)
    assert service.run(first)["state"] == "succeeded"
    assert {n["name"]: n["state"] for n in service.cluster_view()["nodes"]}["node-4"] == "healthy"

    second = service.submit({**EXAMPLE, "drills": []})["id"]
    for _ in range(4):
        tick(second)
    assert service.run(second)["state"] == "running", service.run(second)
    assert {r["node"] for r in service.run(second)["placement"]} == {"node-0", "node-2", "node-3", "node-4"}

    cluster.nodes = full  # node-1 back from repair
    tick(second)
    nodes = {n["name"]: n for n in service.cluster_view()["nodes"]}
    assert nodes["node-1"]["state"] == "spare", "the repaired node refills the pool"
    assert nodes["node-4"]["state"] == "healthy"
    rows = {r["name"]: r for r in registry.node_rows()}
    assert rows["node-1"]["state"] == "returned" and "refills the spare pool" in rows["node-1"]["reason"]

    # The refilled spare is a spare like any: a run that trains on it promotes it again.
    service.controller(second).worker_group.complete()  # type: ignore[attr-defined]
    for _ in range(3):
        tick(second)
    third = service.submit({**EXAMPLE, "drills": []})["id"]
    for _ in range(4):
        tick(third)
    assert "node-1" not in {r["node"] for r in service.run(third)["placement"]}
    cluster.nodes = Topology(tuple(n for n in full.nodes if n.name != "node-0"))
    service.controller(third).worker_group.lose_node("node-0")  # type: ignore[attr-defined]
    for _ in range(4):
        tick(third)
    assert "node-1" in {r["node"] for r in service.run(third)["placement"]}
    nodes = {n["name"]: n["state"] for n in service.cluster_view()["nodes"]}
    assert nodes["node-1"] == "healthy" and nodes["node-0"] == "lost" and "spare" not in nodes.values(), nodes
    from controller.cli.render import describe as _describe

    for event in (service.events(first, after=-1, limit=1000) + service.events(second, after=-1, limit=1000)
                  + service.events(third, after=-1, limit=1000)):
        assert "{" not in _describe(event), _describe(event)


def test_goodput_run_over_another_models_checkpoints_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`goodput run` resumes its own name's checkpoints; when those are of another model it says which
    checkpoints are in the way, in one line, before a cluster starts (before: a traceback)."""
    import subprocess
    import sys

    from trainer.config import ModelConfig

    other = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=128)
    commit(LocalStore(tmp_path / "goodput-runs"), Manifest(
        run_id="tiny-gpt", step=60, attempt=0, mesh={"dp": 2, "pp": 2, "tp": 2}, world_size=8, cursor=960,
        seeds={"data": 0, "init": 0}, identity=state_fingerprint(other), identity_detail=state_identity(other)))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(EXAMPLE))
    proc = subprocess.run([sys.executable, "-m", "controller", "run", "spec.yaml", "--api", "off"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "goodput-runs/tiny-gpt/step-00000060 holds another model's state (d_model 64 there, 128 here)" in lines[0]
    assert "ray" not in proc.stdout.lower() + proc.stderr.lower(), "no cluster was started"


def test_a_killed_services_cluster_folders_go_with_its_processes(tmp_path: Path) -> None:
    """A service SIGKILLed before its shutdown leaves Ray's session folder and the nodes' peer snapshots
    (host memory) behind; the next service on the state dir removes them, and nothing else."""
    from controller.service.main import PIDS_FILE, reap_leftovers

    session, peers = tmp_path / "goodput-ray-abc", tmp_path / "shm" / "goodput-ray-abc"
    other = tmp_path / "not-a-cluster"
    for folder in (session, peers / "node" / "run", other):
        folder.mkdir(parents=True)
    (peers / "node" / "run" / "copy").write_bytes(b"x" * 10)
    state = tmp_path / "state"
    state.mkdir()
    (state / PIDS_FILE).write_text(f"dir {session}\ndir {peers}\ndir {other}\ndir relative/goodput-ray-x\n")
    reap_leftovers(state)
    assert not session.exists() and not peers.exists()
    assert other.exists(), "a folder an embedded cluster does not make is never removed"
    assert not (state / PIDS_FILE).exists()


def test_the_summary_names_health_findings_as_words() -> None:
    """A local run's health counts are keyed by EventKind: the summary shows 'sdc_suspect', not its repr."""
    from controller.cli.render import run_summary
    from controller.events import EventKind

    run = {"name": "r", "state": "succeeded", "step": 3, "attempt": 0, "mesh": {"dp": 1}, "loss": 1.0,
           "history": [{"loss": 2.0}], "goodput": {"ettr": 0.9, "badput_seconds": {}}, "events": [],
           "health": {"counts": {EventKind.SDC_SUSPECT: 1, EventKind.STRAGGLER: 0}}}
    health = run_summary(run)["health"]
    assert health == {"sdc_suspect": 1} and repr(health) == "{'sdc_suspect': 1}"


def test_a_node_back_in_the_tick_its_spare_is_placed_refills_the_pool() -> None:
    """A killed node came back from repair (5 s) in the same tick of the service's node book as the
    run's placement on the spare that replaced it (a recovery slower than the repair: a loaded
    machine). The book gave the returned node its role before it promoted the placed spare, so the
    spare still counted in the pool, the returned node became a training node, and then the spare
    was promoted too: no spare left (tests/cluster/test_readme_service.py failed so under make test)."""
    from controller.service.nodes import NodeBook
    from controller.topology import NodeState

    full = Topology.from_local(**EMBEDDED_CLUSTER)  # node-0..3 train, node-4 is the spare
    book = NodeBook(Registry("sqlite://"))
    holders = {n.name: "run" for n in full.nodes}
    book.track(full, 1.0, holders, {"node-0", "node-1", "node-2", "node-3"})
    book.track(Topology(tuple(n for n in full.nodes if n.name != "node-1")), 2.0, holders,
               {"node-0", "node-1", "node-2", "node-3"})
    assert set(book.lost) == {"node-1"}
    book.track(full, 8.0, holders, {"node-0", "node-2", "node-3", "node-4"})  # back, and the spare placed
    roles = {n.name: n.state for n in book.in_roles(full).nodes}
    assert roles["node-1"] is NodeState.SPARE and roles["node-4"] is NodeState.HEALTHY, roles
    assert not book.lost
