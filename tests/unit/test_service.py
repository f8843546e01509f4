"""The service without Ray: runs queue in submission order for GPUs, cancel works in every state, a
run resumes from its latest or a chosen checkpoint, quarantined nodes stay out of use, and a service
started again on the same registry carries on every unfinished run (as a new attempt from its latest
checkpoint) and still lists every run. The test advances runs itself (no driver threads)."""

from __future__ import annotations

import copy
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from checkpointing.manifest import Manifest, commit
from checkpointing.store import LocalStore
from controller.run_state import RunState
from controller.service.auth import AuthConfigError, check_bind, ensure_token, read_token_file
from controller.service.registry import Registry, sqlite_url
from controller.errors import ServiceError
from controller.service.service import Service
from controller.spec import RunSpec, parse_spec
from controller.topology import Topology
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup, ManualClock

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
CLUSTER = Topology.from_local(nodes=5, gpus_per_node=2, racks=2, spares=1)  # 8 training GPUs + 1 spare node


def raw_spec(name: str, *, dp: int = 2, tp: int = 2, pp: int = 1, steps: int = 40, **extra: Any) -> dict:
    raw = copy.deepcopy(BASE)
    raw.update(name=name, drills=[], parallelism={"dp": dp, "tp": tp, "pp": pp})
    raw["train"]["steps"] = steps
    raw.update(extra)
    return raw


class Harness:
    def __init__(self, db: str, store_root: Path | None = None, topology: Topology = CLUSTER) -> None:
        self.clock = ManualClock(1000.0)
        self.groups: dict[str, list[FakeWorkerGroup]] = {}
        self.registry = Registry(db)
        self.store_root = store_root
        self.service = Service(self.registry, FakeCluster(topology), group_factory=self._group,
                               injector_factory=lambda g: FakeInjector(g),  # type: ignore[arg-type]
                               store_factory=self._store if store_root else None, clock=self.clock, threads=False)

    def _group(self, spec: RunSpec, run_id: str) -> FakeWorkerGroup:
        group = FakeWorkerGroup()
        self.groups.setdefault(spec.name, []).append(group)
        return group

    def _store(self, spec: RunSpec) -> LocalStore:
        assert self.store_root is not None
        return LocalStore(self.store_root)

    def group(self, run_id: str) -> FakeWorkerGroup:
        return self.service.controller(run_id).worker_group  # type: ignore[return-value]

    def tick(self, *run_ids: str, dt: float = 1.0) -> None:
        self.clock.t += dt
        self.service.schedule()
        for run_id in run_ids:
            if self.service.run(run_id)["state"] not in ("pending", "succeeded", "failed", "cancelled"):
                self.service.advance(run_id)

    def until(self, run_id: str, state: str, *others: str) -> None:
        for _ in range(20):
            if self.service.run(run_id)["state"] == state:
                return
            self.tick(run_id, *others)
        raise AssertionError(f"{run_id} is {self.service.run(run_id)['state']}, not {state}")


def test_runs_wait_in_submission_order_for_gpus_and_start_when_capacity_frees(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)))
    s = h.service
    assert s.add(parse_spec(raw_spec("big", dp=2, tp=2)))["state"] == "pending"
    s.add(parse_spec(raw_spec("second", dp=2, tp=2)))  # 4 + 4 GPUs: fits beside the first
    s.add(parse_spec(raw_spec("third", dp=1, tp=2)))  # 2 more: does not fit now
    s.add(parse_spec(raw_spec("small", dp=1, tp=1)))  # would fit a free GPU, but waits its turn
    h.tick("big", "second")
    h.until("big", "running", "second")
    assert s.run("second")["state"] == "running"
    third = s.run("third")
    assert third["state"] == "pending" and "waiting for capacity: 0 free GPU(s)" in third["waiting_for"], third
    assert "earlier" in s.run("small")["waiting_for"]
    nodes_big = {r["node"] for r in s.run("big")["placement"]}
    nodes_second = {r["node"] for r in s.run("second")["placement"]}
    assert not nodes_big & nodes_second, "runs never share a node"
    cluster = s.cluster_view()
    assert cluster["free_gpus"] == 0 and {r["name"]: r["run"] for r in cluster["nodes"]}["node-4"] == "big", \
        "the spare went to the first run admitted"
    h.group("big").finish_steps(1, 40)
    h.group("big").complete()
    h.until("big", "succeeded", "second")
    h.tick("third", "small")
    assert s.run("third")["state"] in ("launching", "running") and s.run("small")["state"] in ("launching", "running")
    assert h.group("big").closed, "an ended run's workers are released"


def test_cancel_works_in_every_state_and_frees_the_gpus(tmp_path: Path) -> None:
    h = Harness(sqlite_url(str(tmp_path)))
    s = h.service
    s.add(parse_spec(raw_spec("a", dp=4, tp=2)))
    s.add(parse_spec(raw_spec("b", dp=4, tp=2)))
    h.until("a", "running")
    assert s.run("b")["state"] == "pending"
    assert s.cancel("b")["state"] == "pending", "takes effect at the next scheduling pass"
    h.tick()
    assert s.run("b")["state"] == "cancelled"
    s.cancel("a")
    h.tick("a")
    assert s.run("a")["state"] == "cancelled" and h.group("a").closed
    assert s.cluster_view()["free_gpus"] == 8
    assert [e["kind"] for e in s.events("a", after=-1, limit=1000)][-1] == "cancelled"
    assert s.cancel("a")["state"] == "cancelled", "cancelling an ended run changes nothing"


def test_a_spec_the_service_cannot_hold_is_refused_with_numbers() -> None:
    h = Harness("sqlite://")
    with pytest.raises(ServiceError) as e:
        h.service.add(parse_spec(raw_spec("huge", dp=8, tp=2)))
    assert e.value.code == "does_not_fit" and "16" in e.value.message
    with pytest.raises(ServiceError) as e:
        h.service.submit({**raw_spec("remote"), "cluster": {"address": "127.0.0.1:6379"}})
    assert e.value.code == "invalid_spec" and "cluster.address" in e.value.message
    with pytest.raises(ServiceError) as e:
        h.service.submit({**raw_spec("x"), "notes": "y" * 70_000})
    assert e.value.code == "spec_too_large"
    with pytest.raises(ServiceError) as e:
        h.service.submit({**raw_spec("x"), "typo": 1})
    assert e.value.code == "invalid_spec" and "typo" in e.value.message


def _commit(root: Path, run_id: str, step: int, *, at: float = 0.0) -> None:
    store = LocalStore(root)
    store.put_bytes(f"{run_id}/step-{step:08d}/data.bin", b"x" * 10)
    import hashlib

    files = {"data.bin": {"size": 10, "sha256": hashlib.sha256(b"x" * 10).hexdigest()}}
    commit(store, Manifest(run_id=run_id, step=step, attempt=0, mesh={"dp": 2, "pp": 1, "tp": 2}, world_size=4,
                           cursor=step * 16, seeds={}, files=files, created_at=at))


def test_a_restarted_service_carries_on_every_unfinished_run(tmp_path: Path) -> None:
    db = sqlite_url(str(tmp_path))
    store = tmp_path / "ckpt"
    h = Harness(db, store)
    s = h.service
    s.add(parse_spec(raw_spec("done", dp=1, tp=1, steps=5)))
    s.add(parse_spec(raw_spec("live", dp=2, tp=2)))
    s.add(parse_spec(raw_spec("queued", dp=4, tp=2)))
    h.until("done", "running", "live")
    h.group("done").finish_steps(1, 5)
    h.group("done").complete()
    h.until("done", "succeeded", "live")
    h.group("live").finish_steps(1, 20)
    _commit(store, "live", 20)
    h.group("live").emit(0, "checkpoint_committed", step=20, seconds=0.1, bytes=10, uri="file://x", removed=[])
    h.group("live").finish_steps(21, 23)
    h.tick("live")
    assert s.run("live")["step"] == 23 and s.run("queued")["state"] == "pending"
    drill = s.request_drill("live", "kill-rank", target="1", at_step=30, factor=None, seconds=None)
    # The service dies here (no stop): its registry is all that is left.
    h2 = Harness(db, store)
    s2 = h2.service
    s2.start()
    assert [r["id"] for r in s2.runs()] == ["done", "live", "queued"], "every run submitted before the restart"
    assert s2.run("done")["state"] == "succeeded"
    kinds = [e["kind"] for e in s2.events("live", after=-1, limit=1000)]
    assert kinds.count("submitted") == 1 and kinds[-1] == "service_restarted"
    h2.until("live", "running")
    attempt = h2.group("live").started[-1]
    assert attempt.attempt == 1 and attempt.resume_step == 20 and attempt.start_step == 20
    assert s2.checkpoints("live")[0]["step"] == 20
    assert [a["attempt"] for a in s2.attempts("live")] == [0, 1]
    assert s2.controller("live").drills.find(drill.id) is not None, "a requested drill survives the restart"
    assert s2.run("queued")["state"] == "pending", "still waits its turn"
    assert s2.controller("live").progress.step == 23, "history carried over; steps after 20 are redone"


def test_resume_from_the_latest_or_a_chosen_step(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    h = Harness(sqlite_url(str(tmp_path)), store)
    s = h.service
    s.add(parse_spec(raw_spec("r", steps=30)))
    h.until("r", "running")
    with pytest.raises(ServiceError) as e:
        s.resume("r", step=None, steps=None)
    assert e.value.code == "run_not_ended"
    h.group("r").finish_steps(1, 30)
    for step in (10, 20, 30):
        _commit(store, "r", step)
        h.group("r").emit(0, "checkpoint_committed", step=step, seconds=0.1, bytes=10, uri="file://x", removed=[])
    h.group("r").complete()
    h.until("r", "succeeded")
    with pytest.raises(ServiceError) as e:
        s.resume("r", step=15, steps=None)
    assert e.value.code == "no_such_checkpoint" and "10, 20, 30" in e.value.message
    run = s.resume("r", step=20, steps=60)
    assert run["state"] == "pending" and run["total_steps"] == 60
    h.until("r", "running")
    attempt = h.group("r").started[-1]
    assert attempt.resume_step == 20 and attempt.config.train.steps == 60
    assert not (store / "r" / "step-00000030" / "manifest.json").exists(), "newer commits are discarded"
    assert [c["step"] for c in s.checkpoints("r")] == [10, 20]


def test_a_quarantined_node_is_out_of_use_for_every_run_and_after_a_restart(tmp_path: Path) -> None:
    db = sqlite_url(str(tmp_path))
    h = Harness(db)
    s = h.service
    s.add(parse_spec(raw_spec("a", dp=2, tp=2)))
    h.until("a", "running")
    h.group("a").finish_steps(1, 3)
    h.group("a").emit(0, "sdc_suspect", step=3, check="periodic", ranks=[3], clean_through_step=0,
                      evidence={"3": ["selftest differs"]})
    h.tick("a")
    node = s.controller("a").quarantined[0]["node"]
    assert {r["name"]: r["state"] for r in s.cluster_view()["nodes"]}[node] == "quarantined"
    h2 = Harness(db)
    assert node not in {n.name for n in h2.service.nodes.usable().nodes}


def test_token_file_is_owner_only_and_serving_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    token, path, made = ensure_token(tmp_path / "state", None)
    assert made and path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ensure_token(tmp_path / "state", None) == (token, path, False)
    os.chmod(path, 0o644)
    with pytest.raises(AuthConfigError, match="chmod 600"):
        read_token_file(path)
    assert ensure_token(tmp_path / "other", "explicit") == ("explicit", None, False)
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "t")
    with pytest.raises(AuthConfigError, match="without a token"):
        check_bind("0.0.0.0", None)


def test_registry_keeps_history_through_a_rollback_and_pages_events() -> None:
    from controller.service.registry import Saved

    r = Registry("sqlite://")
    r.add_run(run_id="x", name="x", spec={}, state="running", created_at=0.0)
    saved = Saved()
    view = {"state": "running", "attempt": 0, "step": 5}
    events = [{"time": float(i), "attempt": 0, "kind": "k", "detail": {"i": i}} for i in range(5)]
    hist = [{"step": s, "loss": 1.0 / s, "attempt": 0, "start": s - 0.5, "end": float(s)} for s in range(1, 6)]
    r.save("x", view, events, hist, saved, 1.0)
    hist2 = hist[:2] + [{"step": s, "loss": 2.0 / s, "attempt": 1, "start": 10 + s - 0.5, "end": 10.0 + s}
                        for s in range(3, 5)]
    r.save("x", view, [], hist2, saved, 2.0)
    assert saved.events == 5
    assert r.history("x") == hist2
    assert r.history("x", after=2, limit=1) == hist2[2:3]
    assert [e["seq"] for e in r.events("x", after=1, limit=2)] == [2, 3]


def test_a_registry_from_before_step_times_gets_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "registry.db"
    with sqlite3.connect(path) as conn:  # the history table as the first service release made it
        conn.execute("CREATE TABLE history (run_id VARCHAR(128) NOT NULL, step INTEGER NOT NULL, loss FLOAT, "
                     "attempt INTEGER NOT NULL, PRIMARY KEY (run_id, step))")
        conn.execute("INSERT INTO history VALUES ('old', 1, 0.5, 0)")
    r = Registry(f"sqlite:///{path}")
    assert r.history("old") == [{"step": 1, "loss": 0.5, "attempt": 0, "start": None, "end": None}]
    Registry(f"sqlite:///{path}")  # opening it again changes nothing


@pytest.mark.parametrize("workers_alive", [True, False])
def test_restart_reattaches_to_live_workers_else_resumes(tmp_path: Path, workers_alive: bool) -> None:
    db = sqlite_url(str(tmp_path))
    store = tmp_path / "ckpt"
    h = Harness(db, store)
    h.service.add(parse_spec(raw_spec("r", dp=2, tp=2, steps=40)))
    h.until("r", "running")
    h.group("r").finish_steps(1, 10)
    _commit(store, "r", 10)
    h.group("r").emit(0, "checkpoint_committed", step=10, seconds=0.1, bytes=10, uri="file://x", removed=[])
    h.group("r").finish_steps(11, 14)
    h.tick("r")
    placement = h.service.run("r")["placement"]

    class Attachable(FakeWorkerGroup):
        def attach(self, attempt: Any) -> bool:
            self.attached = attempt
            if workers_alive:
                self.started.append(attempt)
            return workers_alive

    h2 = Harness(db, store)
    h2.service.group_factory = lambda *_: Attachable()  # type: ignore[assignment,return-value]
    h2.service.start()
    c = h2.service.controller("r")
    group = c.worker_group
    assert isinstance(group, Attachable) and group.attached.attempt == 0
    assert [r["node"] for r in group.attached.placement.rows()] == [r["node"] for r in placement]
    restarted = [e for e in h2.service.events("r", after=-1, limit=1000) if e["kind"] == "service_restarted"]
    if workers_alive:
        assert "re-attached to the live workers of attempt 0" in restarted[0]["detail"]["action"]
        assert c.state is RunState.RUNNING and c.attempt == 0 and group.started == [group.attached]
        group.finish_steps(15, 40)  # what the workers did meanwhile, and after
        group.complete()
        h2.until("r", "succeeded")
        assert h2.service.run("r")["attempt"] == 0 and c.progress.step == 40
        assert not h2.service.cluster_view()["nodes"][0]["run"], "its nodes are free again"
    else:
        assert "resume from the latest verified checkpoint" in restarted[0]["detail"]["action"]
        assert group.closed, "what is left of the old workers is released first"
        h2.until("r", "running")
        assert group.started[-1].attempt == 1 and group.started[-1].resume_step == 10


def test_a_release_that_lands_while_the_driver_notes_quarantines_is_not_undone(tmp_path: Path) -> None:
    """The driver notes a run's quarantines while an operator releases the node. The release is made to
    land exactly between the driver's check and its write (the out-of-use table pops the node while a
    second thread notes): the node must stay released (it used to come back quarantined)."""
    import threading

    h = Harness(sqlite_url(str(tmp_path)))
    s = h.service
    s.add(parse_spec(raw_spec("a", dp=2, tp=2)))
    h.until("a", "running")
    c = s.controller("a")
    node = c.placement.node_of_rank[1]  # type: ignore[union-attr]
    h.group("a").emit(1, "sdc_suspect", step=3, ranks=[1], check="anomaly", clean_through_step=2, evidence={})
    h.tick("a")
    assert s.cluster_view()["nodes"][[n["name"] for n in s.cluster_view()["nodes"]].index(node)]["state"] == "quarantined"
    live = s._runs["a"]  # noqa: SLF001 - the race needs the driver's own call

    noters: list[threading.Thread] = []

    class Interleaving(dict):
        def pop(self, key: Any, *default: Any) -> Any:
            value = super().pop(key, *default)
            noter = threading.Thread(target=s._note_out_of_use, args=(live,))  # noqa: SLF001
            noter.start()
            noter.join(0.3)  # with the check under the lock it waits for the release to finish
            noters.append(noter)
            return value

    s.nodes.book.out_of_use = Interleaving(s.nodes.book.out_of_use)
    s.release_node(node)
    for noter in noters:
        noter.join()
    state = {n["name"]: n["state"] for n in s.cluster_view()["nodes"]}[node]
    assert state != "quarantined", "the release was undone by a concurrent note"
    assert [r["state"] for r in h.registry.node_rows() if r["name"] == node] == ["released"]


def test_admission_admits_what_fits_waits_for_what_could_and_refuses_what_never_can() -> None:
    """The scheduler's rule on hand-made topologies: 8 GPUs free of 12 admit a dp4 x tp2 run; 4 free
    make it wait (saying how many are free); 4 in all refuse it."""
    from controller.service.scheduler import Verdict, admission
    from controller.topology import Topology

    spec = parse_spec(raw_spec("a", dp=4, tp=2))
    six = Topology.from_local(nodes=6, gpus_per_node=2, racks=2, spares=0)
    four, two = Topology(six.nodes[:4]), Topology(six.nodes[:2])
    admitted = admission(spec, four, six)
    assert admitted.verdict is Verdict.ADMIT and admitted.plan is not None
    assert admitted.plan[1].mesh.world_size == 8 and set(admitted.plan[1].nodes_used()) <= {n.name for n in four.nodes}
    waiting = admission(spec, two, six)
    assert waiting.verdict is Verdict.WAIT and "4 free GPU(s)" in waiting.reason and waiting.plan is None
    refused = admission(spec, two, two)
    assert refused.verdict is Verdict.REFUSE and "can no longer hold" in refused.reason


def test_a_resumed_run_takes_free_spares_when_the_healthy_nodes_cannot_hold_it() -> None:
    """A run that trained before (its workers lost, e.g. with a restarted service) may take hot spares'
    places, as few as make it fit; a new run may not: it waits for, or is refused, healthy nodes."""
    from controller.service.scheduler import Verdict, admission
    from controller.topology import NodeState, Topology

    spec = parse_spec(raw_spec("a", dp=4, tp=1))  # 4 GPUs
    four = Topology.from_local(nodes=4, gpus_per_node=2, racks=1, spares=2)
    spares = [n.name for n in four.spares()]
    lost = four.with_states({next(n.name for n in four.nodes if n.name not in spares): NodeState.LOST})
    refused = admission(spec, lost, lost)
    assert refused.verdict is Verdict.REFUSE and "can no longer hold" in refused.reason
    resumed = admission(spec, lost, lost, recovering=True)
    assert resumed.verdict is Verdict.ADMIT and resumed.plan is not None, resumed.reason
    used = set(resumed.plan[1].nodes_used())
    assert len(used & set(spares)) == 1 and resumed.plan[1].mesh.world_size == 4, used
    held = lost.with_states({spares[0]: NodeState.LOST})  # one spare gone too: 4 GPUs left, 2 free now
    free = Topology(tuple(n for n in held.nodes if n.name != spares[1]))
    waiting = admission(spec, free, held, recovering=True)
    assert waiting.verdict is Verdict.WAIT, waiting.reason


def test_a_run_is_planned_once_at_admission_and_a_queued_one_only_when_nodes_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning is the costly part of admission: a queued run is planned again only when the free nodes
    change (not at every scheduler pass), and the run launches with the plan that admitted it."""
    import controller.planner as planner
    import controller.service.scheduler as scheduler
    import controller.state as state

    calls: list[str] = []
    real = planner.plan_run

    def counted(where: str) -> Any:
        def plan(spec: RunSpec, topology: Topology) -> Any:
            calls.append(f"{where}:{spec.name}")
            return real(spec, topology)
        return plan

    monkeypatch.setattr(scheduler, "plan_run", counted("scheduler"))
    monkeypatch.setattr(state, "plan_run", counted("controller"))
    h = Harness(sqlite_url(str(tmp_path)))
    s = h.service
    s.add(parse_spec(raw_spec("big", dp=4, tp=2)))  # 8 of the cluster's GPUs
    s.add(parse_spec(raw_spec("next", dp=2, tp=2)))  # waits for them
    h.until("big", "running")
    assert calls == ["scheduler:big", "scheduler:next", "scheduler:next"], calls  # admitted; free, then total
    for _ in range(5):
        h.tick("big")
    assert calls.count("scheduler:next") == 2, "a queued run is not planned again while nothing changed"
    assert "controller:big" not in calls, "the admitted run launched with its admission's plan"
    h.group("big").finish_steps(1, 40)
    h.group("big").complete()
    h.until("big", "succeeded")
    h.until("next", "running")
    assert calls.count("scheduler:next") == 3 and "controller:next" not in calls, calls


def test_a_service_that_lost_its_cluster_touches_no_run(tmp_path: Path) -> None:
    """A Ray call fails because this process no longer reaches its cluster (a Ray Client session
    ended, the GCS is gone): that is not the run's fault. The run is neither failed nor shut down
    (its workers may train on), nothing is driven any more, and `lost_cluster` says why, for the
    process to end on and a restarted service to re-attach. With the cluster reachable, the same
    error is a controller error: reported, and the run goes on by its failure policy (a restart)."""
    h = Harness(sqlite_url(str(tmp_path)))
    s = h.service
    s.add(parse_spec(raw_spec("a", dp=1, tp=1)))
    s.add(parse_spec(raw_spec("b", dp=1, tp=1)))
    h.until("a", "running", "b")
    h.until("b", "running", "a")

    def broken_poll() -> None:
        raise ConnectionError("Ray Client is not connected. Please connect by calling `ray.init`.")

    for run in ("a", "b"):
        h.group(run).poll = broken_poll  # type: ignore[method-assign]
    reachable = [True]
    s.cluster.connected = lambda: reachable[0]  # type: ignore[attr-defined]
    h.service.advance("b")
    assert s.run("b")["state"] == "launching" and not s.run("b").get("error")
    assert "ConnectionError" in h.service.controller("b").events.of_kind("controller_error")[0].detail["message"]
    reachable[0] = False
    assert h.service.advance("a").value == "running"
    assert s.run("a")["state"] == "running" and h.group("a").shutdowns == 0 and not s.run("a").get("error")
    assert s.lost_cluster is not None and "not connected" in s.lost_cluster
    s.stop()
    assert s.run("a")["state"] == "running" and h.group("a").shutdowns == 0, "stop() touches nothing either"


def test_ctrl_c_in_goodput_run_is_noted_and_raised_at_the_next_poll_not_where_it_lands() -> None:
    """`goodput run`'s Ctrl-C: inside the block a SIGINT sets the event and raises nothing (a
    KeyboardInterrupt raised inside RunLock.acquire once left the run's lock held for good); after it,
    the handler that was there before is back. In another thread (no handler can be set there) the
    block changes nothing."""
    import signal
    import threading

    from controller.service.main import _ctrl_c_between_polls

    before = signal.getsignal(signal.SIGINT)
    with _ctrl_c_between_polls() as interrupted:
        assert not interrupted.is_set()
        signal.raise_signal(signal.SIGINT)  # (handled before raise_signal returns)
        assert interrupted.is_set()
    assert signal.getsignal(signal.SIGINT) is before

    seen: list[object] = []

    def elsewhere() -> None:
        with _ctrl_c_between_polls() as event:
            seen.append((event.is_set(), signal.getsignal(signal.SIGINT)))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [(False, before)]
