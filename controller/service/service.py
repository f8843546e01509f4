"""The service's runs: many at once on one cluster, queued in submission order, persisted, and carried
on after the service itself restarts.

Each admitted run has its own driver thread that advances its `RunController` (and nothing else), so
one run's slow launch, drill or recovery never holds up another's polling. The scheduler thread admits
pending runs in submission order when their plan fits the nodes no other run holds. A run holds the
nodes of its placement and the spares free when it was admitted (first come, first served), plus nodes
it lost while it lives; a node one run quarantines is out of use for every run, and stays so across
restarts.

Admission is service/scheduler.py's rule, node bookkeeping service/nodes.py's, and what a restarted
service does with the runs its registry shows service/restore.py's.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Callable, Protocol

from checkpointing.store import anchored
from controller.errors import ServiceError
from controller.events import EventKind
from controller.drills import DrillError, DrillInjector, DrillRequest
from controller.service.live import LiveRun, RunLock
from controller.service.nodes import NodeBook
from controller.service.registry import Registry
from controller.service.restore import Carried, carry_on
from controller.service.scheduler import BEHIND_EARLIER, Verdict, admission
from controller.spec import RunSpec, SpecError, parse_spec
from controller.attempt import WorkerGroup
from controller.planner import plan_run
from controller.state import RunController, RunState
from controller.topology import Topology

MAX_SPEC_BYTES = 64 * 1024
MAX_DRILLS_PER_RUN = 64
MAX_RUN_ID = 64
MAX_EVENTS_PAGE = 1000
MAX_HISTORY_PAGE = 10000
MAX_RUNS = 10_000


class Cluster(Protocol):
    def topology(self) -> Topology: ...


GroupFactory = Callable[[RunSpec, str], WorkerGroup]
"""(spec, run id) -> the run's worker group."""
InjectorFactory = Callable[[WorkerGroup], DrillInjector | None]
StoreFactory = Callable[[RunSpec], Any]


class NodeActions(Protocol):
    """What quarantine and release do outside goodput (Kubernetes: cordon and taint)."""

    def quarantine(self, node: str, reason: str) -> Any: ...

    def release(self, node: str) -> Any: ...


class Service:
    def __init__(self, registry: Registry, cluster: Cluster, *, group_factory: GroupFactory,
                 injector_factory: InjectorFactory | None = None, store_factory: StoreFactory | None = None,
                 clock: Callable[[], float] = time.time, poll_s: float = 0.2, accept_submissions: bool = True,
                 view: Callable[[Topology], Topology] | None = None, threads: bool = True,
                 node_actions: NodeActions | None = None,
                 store_probe: Callable[[Any, str], None] | None = None,
                 relative_root: Path | None = None) -> None:
        self.registry = registry
        self.cluster = cluster
        self.group_factory = group_factory
        self.injector_factory = injector_factory
        self.store_factory = store_factory
        self.store_probe = store_probe
        """(store, uri) -> None, or SpecError saying why it cannot be written: asked at submission, for at
        most STORE_PROBE_WAIT_S (a store that answers later is the run's to wait for at launch)."""
        self.relative_root = relative_root
        """Where a submitted spec's relative checkpoint path lands (the service's state dir); None: the cwd."""
        self.clock = clock
        self.poll_s = poll_s
        self.accept_submissions = accept_submissions
        self.threads = threads
        """Schedule, and drive each admitted run, in threads (False: the caller calls `schedule` and `advance`)."""
        self.view = view or (lambda t: t)
        """Which of the cluster's nodes this service may use (all of them, unless told)."""
        self.lock = threading.RLock()
        """Admission and node ownership; never held while a run's controller steps (except its admission)."""
        self._runs: dict[str, LiveRun] = {}
        self._stop = threading.Event()
        self._scheduler: threading.Thread | None = None
        self.nodes = NodeBook(registry)
        self.node_actions = node_actions
        """Kubernetes' side of quarantine and release (controller.k8s.nodes), None outside a cluster."""

    # -- life -------------------------------------------------------------------------------------------
    def start(self) -> "Service":
        """Carry on the runs the registry shows unfinished, then admit runs as capacity allows."""
        self._restore()
        if self.threads:
            self._scheduler = threading.Thread(target=self._schedule_loop, name="goodput-scheduler", daemon=True)
            self._scheduler.start()
        return self

    def stop(self) -> None:
        """Stop driving: every run's workers are shut down; unfinished runs stay unfinished in the
        registry and go on when a service starts again on it."""
        self._stop.set()
        if self._scheduler is not None:
            self._scheduler.join(timeout=10)
        for live in list(self._runs.values()):
            if live.thread is not None:
                live.thread.join(timeout=30)
            with live.lock:
                if live.closed:
                    continue
                if not live.controller.state.terminal and live.admitted:
                    live.controller.record(self.clock(), EventKind.SERVICE_STOPPED)
                self._close(live)
                self._save(live)

    # -- requests ---------------------------------------------------------------------------------------
    def submit(self, raw: Any) -> dict[str, Any]:
        """A run submitted through the API (refused by the one-run service of `goodput run`)."""
        if not self.accept_submissions:
            raise ServiceError("submissions_closed", "this API serves the one run of `goodput run`; "
                                                          "submit runs to `goodput serve`")
        spec = self._parse(raw)
        if spec.cluster.address is not None:
            raise ServiceError("invalid_spec", "cluster.address is for `goodput run`; the service runs every "
                                                    "run on its own cluster: remove it")
        if self.relative_root is not None:  # not the cwd of wherever the service was started
            uri = anchored(spec.checkpoint.uri, self.relative_root)
            if uri != spec.checkpoint.uri:
                spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": uri})})
        return self.add(spec)

    def add(self, spec: RunSpec) -> dict[str, Any]:
        """Queue a validated spec; the Run object (pending)."""
        with self.lock:
            candidates = self._free_ids(spec.name, self.ID_CANDIDATES)
        # Asks the store, never under the service lock. goodput serve: a submission is a new run, so its
        # id must be one whose prefix holds nothing (a finished run's, `make run`'s, anyone's); goodput
        # run: the run's own name, whose checkpoints it resumes (if they are of its model).
        store, occupied = self._store(spec, candidates=candidates, fresh=self.accept_submissions)
        with self.lock:
            if len(self._runs) >= MAX_RUNS:
                raise ServiceError("too_many_runs", f"the service holds {MAX_RUNS} runs")
            try:
                plan_run(spec, self._total_view())
            except SpecError as e:
                raise ServiceError("does_not_fit", f"this service's cluster cannot hold the run: {e}") from None
            run_id = self._new_id(spec.name, skip=occupied)
            now = self.clock()
            group = self.group_factory(spec, run_id)
            controller = RunController(spec, self._total_view(), group, now=now, checkpoint_store=store,
                                       run_id=run_id, injector=self._injector(group),
                                       topology_source=lambda: self._own_view(run_id),
                                       own_checkpoints_only=self.accept_submissions)
            if occupied:
                controller.record(now, EventKind.RUN_ID_CHOSEN, run_id=run_id, name=spec.name,
                                      reason=f"{', '.join(occupied)} already hold checkpoints in {store.uri}: a "
                                             "submission starts a new run (goodput resume continues an old one)",
                                      occupied=occupied)
            seq = self.registry.add_run(run_id=run_id, name=spec.name, spec=spec.model_dump(mode="json"),
                                        state=controller.state.value, created_at=now)
            live = LiveRun(controller, seq, group)
            self._runs[run_id] = live
            self._save(live)
            return self._last_view(live)

    def runs(self) -> list[dict[str, Any]]:
        return [self._last_view(live) for live in sorted(self._runs.values(), key=lambda r: r.seq)]

    def run(self, run_id: str) -> dict[str, Any]:
        return self._last_view(self._live(run_id))

    def _last_view(self, live: LiveRun) -> dict[str, Any]:
        return live.view if live.view is not None else self._view(live)

    # Reads come from the registry and from each run's last saved view: a run's driver saves after every
    # step, so a read never waits for a step (a launch can take seconds) and is never older than one.
    def events(self, run_id: str, *, after: int, limit: int) -> list[dict[str, Any]]:
        self._live(run_id)
        return self.registry.events(run_id, after=after, limit=limit)

    def history(self, run_id: str, *, after: int, limit: int) -> list[dict[str, Any]]:
        """Kept steps after step `after`: {step, loss, attempt, start, end}."""
        self._live(run_id)
        return self.registry.history(run_id, after=after, limit=limit)

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        self._live(run_id)
        return self.registry.attempts(run_id)

    RECONCILE_WAIT_S = 0.5
    """How long a checkpoints request waits for the store before answering from the index."""

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """The committed checkpoints. The index follows the events, and the store is the truth: a commit
        whose event died with its node is added, a step no longer in the store is marked retired. The
        reconciliation runs in the background (one at a time per run); a slow store gets the index as
        it stands after RECONCILE_WAIT_S, and the next request sees what the store said."""
        live = self._live(run_id)
        if live.controller.checkpoints.store is not None:
            with live.lock:
                thread = live.reconciling
                if thread is None or not thread.is_alive():
                    thread = live.reconciling = threading.Thread(
                        target=self._reconcile_checkpoints, args=(live,), name=f"goodput-index-{run_id}", daemon=True)
                    thread.start()
            thread.join(self.RECONCILE_WAIT_S)
        return self.registry.checkpoints(run_id)

    def _reconcile_checkpoints(self, live: LiveRun) -> None:
        from checkpointing.manifest import index_changes, step_prefix
        from checkpointing.store import StoreError

        run_id, store = live.controller.run_id, live.controller.checkpoints.store
        assert store is not None
        try:
            missing, gone = index_changes(store, run_id, {r["step"] for r in self.registry.checkpoints(run_id)})
        except StoreError:
            return  # the index as it stands; the store answers again later
        for m in missing:
            self.registry.index_checkpoint(run_id, step=m.step, attempt=m.attempt, committed_at=m.created_at,
                                           uri=f"{store.uri}/{step_prefix(run_id, m.step)}", size=m.total_bytes())
        for step in gone:
            self.registry.set_checkpoint_state(run_id, step, "retired")

    def cancel(self, run_id: str) -> dict[str, Any]:
        """Ask a run to stop: a flag its driver acts on at its next step (a launch in progress gives up
        first), so this never waits for the run, whatever it is doing. The Run object as last saved."""
        live = self._live(run_id)
        if not live.controller.state.terminal:
            live.controller.cancel()
        return self._last_view(live)

    def resume(self, run_id: str, *, step: int | None, steps: int | None) -> dict[str, Any]:
        live = self._live(run_id)
        thread = live.thread
        if thread is not None and live.controller.state.terminal:
            thread.join(1.0)  # an ended run's driver is on its way out (its last save): not a reason to refuse
        committed = {r["step"] for r in self.checkpoints(run_id)} if step is not None else set()  # no lock held
        with self.lock, live.lock:
            c = live.controller
            if not c.state.terminal or (live.thread is not None and live.thread.is_alive()):
                raise ServiceError("run_not_ended", f"run {run_id!r} is {c.state.value}; only a succeeded, "
                                                         "failed or cancelled run can be resumed")
            spec = c.spec
            if steps is not None:
                if steps < c.progress.step:
                    raise ServiceError("invalid_request", f"steps = {steps} is below the run's step "
                                                               f"{c.progress.step}")
                spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": steps})})
            if step is not None:
                if step not in committed:
                    known = sorted(committed)
                    raise ServiceError("no_such_checkpoint", f"run {run_id!r} has no committed step {step}; "
                                                                  f"committed: {known or 'none'}")
            live.group = self.group_factory(spec, run_id)
            c.resume(self.clock(), step=step, steps=steps, spec=spec, worker_group=live.group,
                     injector=self._injector(live.group))
            self.registry.set_spec(run_id, spec.model_dump(mode="json"))
            live.admitted, live.closed, live.thread = False, False, None
            self._save(live)
            return self._view(live)

    def request_drill(self, run_id: str, kind: str, *, target: str | None, at_step: int | None,
                      factor: float | None, seconds: float | None) -> DrillRequest:
        live = self._live(run_id)
        with live.lock:
            c = live.controller
            if c.state.terminal:
                raise ServiceError("run_ended", f"run {run_id!r} has {c.state.value}; drills need a live run")
            if len(c.drills.pending()) + c.events.count(EventKind.DRILL_INJECTED) >= MAX_DRILLS_PER_RUN:
                raise ServiceError("too_many_drills", f"run {run_id!r} has had {MAX_DRILLS_PER_RUN} drills")
            try:
                request = c.request_drill(self.clock(), kind, target=target, at_step=at_step, factor=factor,
                                          seconds=seconds)
            except DrillError as e:
                raise ServiceError("drill_rejected", str(e)) from None
        self._save(live)
        return request

    def drill(self, drill_id: str) -> dict[str, Any]:
        for live in list(self._runs.values()):
            with live.lock:  # never held across slow calls (RunLock.released)
                report = live.controller.drill(drill_id)
            if report is not None:
                return {**report, "run_id": live.controller.run_id}
        raise ServiceError("drill_not_found", f"no drill {drill_id!r} on this service")

    def cluster_view(self) -> dict[str, Any]:
        """Every node with its state for the service (healthy, spare, quarantined, lost) and the run on it."""
        with self.lock:
            try:
                live_nodes = {n.name: n for n in self._cluster_topology().nodes}
            except Exception:  # noqa: BLE001 - a cluster that does not answer shows no live node
                live_nodes = {}
            rows = self.nodes.rows(live_nodes, self._holders())
        return {"nodes": rows, "gpus": sum(r["gpus"] for r in rows),
                "free_gpus": sum(r["gpus"] for r in rows if r["run"] is None and r["state"] == "healthy")}

    def wait(self, run_id: str, *, timeout_s: float | None = None, on_tick: Callable[[RunController], None] | None = None,
             poll_s: float = 0.2) -> dict[str, Any]:
        """Block until the run ends (for `goodput run` and tests); on_tick sees the controller each poll."""
        live = self._live(run_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with live.lock:
                if on_tick is not None:
                    on_tick(live.controller)
                ended = live.controller.state.terminal and live.closed
            if ended:
                return self.run(run_id)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} did not end in {timeout_s:.0f} s")
            time.sleep(poll_s)

    def controller(self, run_id: str) -> RunController:
        return self._live(run_id).controller

    def live_controllers(self) -> list[tuple[str, RunController, RunLock]]:
        """(run id, its controller, the lock to hold while reading it) for every run of this service,
        in submission order (what /metrics exports)."""
        with self.lock:
            lives = sorted(self._runs.values(), key=lambda live: live.seq)
        return [(live.controller.run_id, live.controller, live.lock) for live in lives]

    # -- scheduling -----------------------------------------------------------------------------------
    def _schedule_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.schedule()
            except Exception as e:  # noqa: BLE001 - a scheduling error must not stop the service
                print(f"goodput serve: scheduler: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            self._stop.wait(self.poll_s)

    def schedule(self) -> None:
        """Admit pending runs in submission order while their plans fit the free nodes."""
        self.track_nodes()
        with self.lock:
            blocked = False
            for live in sorted(self._runs.values(), key=lambda r: r.seq):
                c = live.controller
                if live.admitted or c.state.terminal:
                    continue
                if c.cancel_requested:
                    with live.lock:
                        c.step(self.clock())
                    self._close(live)
                    self._save(live)
                    continue
                if blocked:  # no overtaking
                    self._wait(live, BEHIND_EARLIER)
                    continue
                free = self._free_view()
                verdict, reason = admission(c.spec, free, self._total_view())
                if verdict is Verdict.REFUSE:
                    with live.lock:
                        c.fail(self.clock(), "no_capacity", reason)
                    self._close(live)
                    self._save(live)
                    continue
                if verdict is Verdict.WAIT:
                    self._wait(live, reason)
                    blocked = True
                    continue
                self._admit(live, free)

    def _wait(self, live: LiveRun, reason: str) -> None:
        if live.controller.wait_for(reason):
            self._save(live)

    def _admit(self, live: LiveRun, free: Topology) -> None:
        c = live.controller
        with live.lock:
            c.admit(free)
            now = self.clock()
            while c.state in (RunState.PENDING, RunState.PLANNING):
                c.step(now)
            if c.placement is not None and not c.state.terminal:
                c.confine(set(c.placement.nodes_used()) | {n.name for n in free.spares()})
            live.admitted = True
        self._save(live)
        if self.threads:
            self._start_driver(live)

    def _start_driver(self, live: LiveRun) -> None:
        live.thread = threading.Thread(target=self._drive, args=(live,), name=f"goodput-run-{live.controller.run_id}",
                                       daemon=True)
        live.thread.start()

    def _drive(self, live: LiveRun) -> None:
        """Step the run until it ends: at once after a transition, else every poll_s (running, waiting
        for capacity or for the store: nothing spins)."""
        while not self._stop.is_set():
            before = live.controller.state
            state = self.advance(live.controller.run_id)
            if state.terminal:
                return
            if state is RunState.RUNNING or state is before:
                self._stop.wait(self.poll_s)

    def advance(self, run_id: str, now: float | None = None) -> RunState:
        """One step of a run's controller, then persist it (what its driver thread repeats; tests call
        it directly on a service whose runs have no threads)."""
        live = self._live(run_id)
        c = live.controller
        try:
            with live.lock:
                state = c.step(self.clock() if now is None else now)
        except Exception as e:  # noqa: BLE001 - a controller bug ends this run, not the service
            with live.lock:
                c.fail(self.clock(), "controller_error", f"{type(e).__name__}: {e}")
            state = c.state
        try:
            self._note_out_of_use(live)
            if state.terminal and not live.closed:
                self._close(live)
        finally:
            try:
                self._save(live)
            except Exception as e:  # noqa: BLE001 - the run goes on; its stored view is one step older
                print(f"goodput: run {run_id}: saving its state failed: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        return state

    def _close(self, live: LiveRun) -> None:
        """Release the run's workers (and with them its GPU slots)."""
        close = getattr(live.group, "close", None) or live.group.shutdown
        try:
            close()
        finally:
            live.closed = True

    # -- nodes ------------------------------------------------------------------------------------------
    def _holders(self) -> dict[str, str]:
        """node -> the live run that holds it."""
        held: dict[str, str] = {}
        for live in self._runs.values():
            c = live.controller
            if not live.admitted or (c.state.terminal and live.closed):
                continue
            for node in c.topology.nodes:
                held.setdefault(node.name, c.run_id)
        return held

    def _total_view(self) -> Topology:
        """Every node the service may use, held or not (what a run could ever get)."""
        nodes = [n for n in self._cluster_topology().nodes if n.name not in self.nodes.out_of_use]
        return Topology(tuple(nodes))

    def _free_view(self) -> Topology:
        held = self._holders()
        return Topology(tuple(n for n in self._total_view().nodes if n.name not in held))

    def _own_view(self, run_id: str) -> Topology:
        """What the cluster shows of a run's own nodes (the controller merges back nodes it lost)."""
        live = self._runs[run_id]
        own = {n.name for n in live.controller.topology.nodes}
        return Topology(tuple(n for n in self._cluster_topology().nodes if n.name in own))

    def _cluster_topology(self) -> Topology:
        """The nodes the cluster shows this service, each in the service's role for it."""
        return self.nodes.in_roles(self.view(self.cluster.topology()))

    def track_nodes(self) -> None:
        """Notice nodes the cluster lost and got back, and keep the spare pool honest (NodeBook.track).
        Called by the scheduler every pass."""
        try:
            raw = self.view(self.cluster.topology())
        except Exception:  # noqa: BLE001 - a cluster that does not answer changes nothing here
            return
        with self.lock:
            placed = {row["node"] for live in self._runs.values()
                      if live.admitted and not live.closed and live.view is not None
                      for row in live.view.get("placement") or []}
            self.nodes.track(raw, self.clock(), self._holders(), placed)

    def _note_out_of_use(self, live: LiveRun) -> None:
        """A node a run quarantined is out of use for every run until an operator releases it; on
        Kubernetes it is also cordoned and tainted (not a lost node: its pod died, not the node)."""
        for q in list(live.controller.quarantined):
            with self.lock:  # checked and set in one go: a release in between must not be undone
                if not self.nodes.quarantine(q["node"], q["reason"], live.controller.run_id, q["time"]):
                    continue
            if self.node_actions is not None and q["reason"] != "lost":
                threading.Thread(target=self._cordon, args=(live, q["node"], str(q["reason"])),
                                 name=f"goodput-cordon-{q['node']}", daemon=True).start()

    def _cordon(self, live: LiveRun, node: str, reason: str) -> None:
        """Cordon and taint the node through the node actions; the outcome joins the run's timeline."""
        assert self.node_actions is not None
        try:
            outcome = self.node_actions.quarantine(node, reason)
            kind, detail = EventKind.NODE_CORDONED, {"node": node, "action": outcome.action, "detail": outcome.detail}
        except Exception as e:  # noqa: BLE001 - the quarantine stands in goodput; say why Kubernetes did not follow
            kind, detail = EventKind.NODE_CORDON_FAILED, {"node": node, "error": f"{type(e).__name__}: {e}"}
            print(f"goodput serve: could not cordon {node}: {e}", file=sys.stderr, flush=True)
        with live.lock:
            live.controller.record(self.clock(), kind, **detail)
        self._save(live)

    def release_node(self, name: str) -> dict[str, Any]:
        """An operator's explicit release of a quarantined node: usable by new runs again; on
        Kubernetes its taint goes (and the cordon, if goodput made it). Runs that quarantined it keep
        it out of their own topology."""
        try:
            raw: Topology | None = self.view(self.cluster.topology())
        except Exception:  # noqa: BLE001 - no answer from the cluster: its label decides the role
            raw = None
        with self.lock:  # every quarantine of it so far is answered by this release
            when = max([self.clock()] + [q["time"] for live in self._runs.values()
                                         for q in list(live.controller.quarantined) if q["node"] == name])
            row, role = self.nodes.release(name, when, raw)
        kubernetes = None
        if self.node_actions is not None:
            try:
                kubernetes = self.node_actions.release(name).detail
            except Exception as e:  # noqa: BLE001 - released in goodput; the operator must finish in Kubernetes
                kubernetes = (f"not released in Kubernetes ({type(e).__name__}: {e}); remove the taint {name} "
                              "goodput.dev/quarantined and uncordon it by hand")
        return {"name": name, "state": role, "was": row, "kubernetes": kubernetes}

    # -- persistence -----------------------------------------------------------------------------------
    def _save(self, live: LiveRun) -> None:
        with live.lock:
            c = live.controller
            now = self.clock()
            view = self._view(live, now)
            new_events = [e.to_dict() for e in c.events.since(live.saved.events)]
            self.registry.save(c.run_id, view, new_events, c.progress.history, live.saved, now)
            live.view = view

    def _view(self, live: LiveRun, now: float | None = None) -> dict[str, Any]:
        with live.lock:
            out = live.controller.to_dict(self.clock() if now is None else now, full=False)
        return out

    def _restore(self) -> None:
        """Build every run of the registry again and carry it on (service/restore.py says how)."""
        now = self.clock()
        for row in self.registry.run_rows():
            run_id = row["id"]
            spec = parse_spec(row["spec"])
            group = self.group_factory(spec, run_id)
            try:
                store, _ = self._store(spec)
            except ServiceError:
                store = None
            c = RunController(spec, self._total_view(), group, now=row["created_at"], checkpoint_store=store,
                              run_id=run_id, injector=self._injector(group),
                              topology_source=functools.partial(self._own_view, run_id),
                              own_checkpoints_only=self.accept_submissions)
            events = self.registry.all_events(run_id)
            c.restore(events=events, history=self.registry.history(run_id))
            live = LiveRun(c, int(row["seq"]), group)
            live.saved.events = len(events)
            live.saved.history = [(int(h["step"]), int(h["attempt"])) for h in c.progress.history]
            carried = carry_on(c, row, events, store_reachable=store is not None, now=now)
            live.admitted = carried in (Carried.ENDED, Carried.REATTACHED, Carried.FAILED)
            live.closed = carried in (Carried.ENDED, Carried.FAILED)
            self._runs[run_id] = live
            self._save(live)
        for live in self._runs.values():
            if live.admitted and not live.closed and self.threads:
                self._start_driver(live)

    # -- helpers ---------------------------------------------------------------------------------------
    def _live(self, run_id: str) -> LiveRun:
        live = self._runs.get(run_id)
        if live is None:
            raise ServiceError("run_not_found", f"no run {run_id!r} on this service (`goodput list` shows its runs)")
        return live

    def _parse(self, raw: Any) -> RunSpec:
        import json

        try:
            size = len(json.dumps(raw))
        except (TypeError, ValueError):
            raise ServiceError("invalid_spec", "the run spec must be a JSON object") from None
        if size > MAX_SPEC_BYTES:
            raise ServiceError("spec_too_large", f"the run spec is {size} bytes; at most {MAX_SPEC_BYTES}")
        try:
            spec = parse_spec(raw)
        except SpecError as e:
            raise ServiceError("invalid_spec", str(e)) from None
        if len(spec.name) > MAX_RUN_ID - 8:
            raise ServiceError("invalid_spec", f"name is {len(spec.name)} characters; at most {MAX_RUN_ID - 8}")
        if len(spec.drills) > MAX_DRILLS_PER_RUN:
            raise ServiceError("invalid_spec", f"{len(spec.drills)} drills; at most {MAX_DRILLS_PER_RUN} per run")
        return spec

    STORE_PROBE_WAIT_S = 0.5

    ID_CANDIDATES = 8
    """Ids a submission asks the store about (name, name-2, ...), within STORE_PROBE_WAIT_S in all."""

    def _store(self, spec: RunSpec, *, candidates: list[str] | None = None, fresh: bool = False
               ) -> tuple[Any, dict[str, list[int]]]:
        """The run's checkpoint store, and {candidate id: its committed steps} for the candidates whose
        prefix already holds objects. Given candidate ids, the store is also asked, for at most
        STORE_PROBE_WAIT_S in all, whether it takes a write (422 saying why not); then, for a fresh run,
        which candidates are occupied (in order, until a free one), else whether the first holds another
        model's checkpoints (409). A store that answers later is the run's to wait for at launch
        (store_unavailable), not the request's; a fresh run launched over an occupied prefix it could not
        see here refuses at launch (checkpoints_in_the_way) instead of loading them."""
        if self.store_factory is None:
            return None, {}
        try:
            store = self.store_factory(spec)
        except SpecError as e:
            raise ServiceError("invalid_spec", str(e)) from None
        if not candidates:
            return store, {}
        from checkpointing.manifest import IdentityMismatch, check_identity, committed_steps, read_manifest
        from trainer.config import state_fingerprint, state_identity

        occupied: dict[str, list[int]] = {}

        def ask() -> None:
            if self.store_probe is not None:
                self.store_probe(store, spec.checkpoint.uri)
            if fresh:
                for run_id in candidates:
                    if not store.list(f"{run_id}/"):
                        return
                    occupied[run_id] = committed_steps(store, run_id)
                return
            steps = committed_steps(store, candidates[0])
            if steps:
                model = spec.to_model_config()
                check_identity(read_manifest(store, candidates[0], steps[-1]), state_fingerprint(model),
                               state_identity(model), store.uri)

        error = _within(self.STORE_PROBE_WAIT_S, ask)
        if isinstance(error, SpecError):
            raise ServiceError("invalid_spec", str(error)) from None
        if isinstance(error, IdentityMismatch):
            raise ServiceError("checkpoint_mismatch", str(error)) from None
        return store, dict(occupied)

    def _injector(self, group: WorkerGroup) -> DrillInjector | None:
        return self.injector_factory(group) if self.injector_factory is not None else None

    def _new_id(self, name: str, *, skip: Collection[str] = ()) -> str:
        """The spec's name, or name-2, name-3, ... when taken by a run of this service or in `skip`
        (ids are checkpoint prefixes: never shared)."""
        return self._free_ids(name, 1, skip=skip)[0]

    def _free_ids(self, name: str, count: int, *, skip: Collection[str] = ()) -> list[str]:
        """The first `count` ids of name, name-2, name-3, ... that no run of this service has."""
        out: list[str] = []
        n = 1
        while len(out) < count:
            run_id = name if n == 1 else f"{name}-{n}"
            if run_id not in self._runs and run_id not in skip and not self.registry.has_run(run_id):
                out.append(run_id)
            n += 1
        return out


def _within(seconds: float, fn: Callable[[], None]) -> BaseException | None:
    """Run fn in a thread for at most `seconds`: the exception it raised in time, else None (it
    succeeded, or is still waiting on something slow and is left to finish on its own)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append(e)

    thread = threading.Thread(target=run, name="goodput-bounded-call", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else None
