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
import traceback
from pathlib import Path
from typing import Any, Callable

from controller.errors import ServiceError
from controller.events import EventKind
from controller.drills import DrillError, DrillInjector, DrillRequest
from controller.service.identity import DEFAULT_TEAM
from controller.service.intake import (
    ID_CANDIDATES, MAX_RUNS, StoreFactory, drill_allowed, free_ids, parse_submission, resume_spec, run_store,
)
from controller.service.live import LiveRun, RunLock
from controller.service.nodes import Cluster, NodeActions, ServiceNodes
from controller.service.registry import Registry
from controller.service.restore import Carried, carry_on
from controller.service.accounts import team_quotas, team_rows
from controller.service.scheduler import (
    BEHIND_EARLIER, Queued, Running, Verdict, free_gpus, preemption_victims, queue_order, quota_problem, requested_gpus,
)
from controller.providers import with_model_numbers
from controller.run_state import RunState
from controller.spec import PRIORITY_CLASSES, RunSpec, SpecError, parse_spec
from controller.attempt import WorkerGroup
from controller.placement import Placement
from controller.planner import MeshPlan, plan_run
from controller.state import RunController
from controller.topology import Topology



GroupFactory = Callable[[RunSpec, str], WorkerGroup]
"""(spec, run id) -> the run's worker group."""
InjectorFactory = Callable[[WorkerGroup], DrillInjector | None]


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
        self.lock = threading.RLock()
        """Admission and node ownership; never held while a run's controller steps (except its admission)."""
        self._runs: dict[str, LiveRun] = {}
        self._stop = threading.Event()
        self.lost_cluster: str | None = None
        self.lost_lead: str | None = None
        """Why this service stopped leading (its registry lock was taken from it), if it did."""
        """Why this process no longer reaches its Ray cluster (None: it does). Then nothing is driven
        and no run is touched: the process ends, and one started again re-attaches to the runs."""
        self._scheduler: threading.Thread | None = None
        self.nodes = ServiceNodes(registry, cluster, lock=self.lock, holders=self._holders, view=view,
                                  node_actions=node_actions, clock=clock)

    # -- life -------------------------------------------------------------------------------------------
    def start(self) -> "Service":
        """Carry on the runs the registry shows unfinished, then admit runs as capacity allows."""
        self._restore()
        if self.threads:
            self._scheduler = threading.Thread(target=self._schedule_loop, name="goodput-scheduler", daemon=True)
            self._scheduler.start()
        return self

    def reaches_cluster(self) -> bool:
        connected = getattr(self.cluster, "connected", None)
        return connected() if connected is not None else True

    def isolated(self) -> str | None:
        """Why this service suspects itself cut off from its runs' nodes: every run it drives that is
        training hears no heartbeat at all (None: one hears some, or none is training)."""
        with self.lock:
            running = [live.controller for live in self._runs.values()
                       if not live.closed and live.controller.state is RunState.RUNNING]
        whys = [c.isolated for c in running]
        return whys[0] if whys and all(whys) else None

    def cluster_lost(self, why: str) -> None:
        """This process lost its Ray cluster: stop driving at once, touching no run (their workers may
        well train on); `lost_cluster` says why, for the process to end on."""
        if self.lost_cluster is None:
            self.lost_cluster = why
        self._halt()

    def lead_lost(self, why: str) -> None:
        """This process lost the registry's lock: another service may lead now. Stop driving at once,
        touching no run and writing nothing more (the new leader re-attaches to the runs)."""
        if self.lost_lead is None:
            self.lost_lead = why
        self._halt()

    def _halt(self) -> None:
        """Every loop of this service ends now (the drivers' waits too)."""
        self._stop.set()
        for live in list(self._runs.values()):
            live.wake.set()

    def stop(self) -> None:
        """Stop driving: every run's workers are shut down; unfinished runs stay unfinished in the
        registry and go on when a service starts again on it. After `cluster_lost`, nothing is shut
        down (nothing can be): the runs are left for the next service to re-attach to."""
        if self.lost_cluster is not None or self.lost_lead is not None:
            self._halt()
            return
        self._halt()
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
                live.close()
                self._save(live)

    # -- requests ---------------------------------------------------------------------------------------
    def submit(self, raw: Any, *, team: str = DEFAULT_TEAM) -> dict[str, Any]:
        """A run submitted through the API for `team` (refused by the one-run service of `goodput run`)."""
        if not self.accept_submissions:
            raise ServiceError("submissions_closed", "this API serves the one run of `goodput run`; "
                                                          "submit runs to `goodput serve`")
        return self.add(parse_submission(raw, relative_root=self.relative_root), team=team)

    def add(self, spec: RunSpec, *, team: str = DEFAULT_TEAM) -> dict[str, Any]:
        """Queue a validated spec of `team`; the Run object (pending). A provider model is asked for its
        numbers first: one this service cannot import is refused (invalid_spec, saying what to install)."""
        try:
            spec = with_model_numbers(spec)
        except SpecError as e:
            raise ServiceError("invalid_spec", str(e)) from None
        with self.lock:
            candidates = free_ids(spec.name, ID_CANDIDATES, self._id_taken)
        # Asks the store, never under the service lock. goodput serve: a submission is a new run, so its
        # id must be one whose prefix holds nothing (a finished run's, `make run`'s, anyone's); goodput
        # run: the run's own name, whose checkpoints it resumes (if they are of its model).
        store, occupied = run_store(spec, self.store_factory, probe=self.store_probe, candidates=candidates,
                                   fresh=self.accept_submissions)
        with self.lock:
            if len(self._runs) >= MAX_RUNS:
                raise ServiceError("too_many_runs", f"the service holds {MAX_RUNS} runs")
            usable = self.nodes.usable()
            try:
                plan_run(spec, usable)
            except SpecError as e:
                raise ServiceError("does_not_fit", f"this service's cluster cannot hold the run: {e}") from None
            quota = team_quotas(self.registry).get(team)
            if quota is not None and (need := requested_gpus(spec, usable)) > quota:
                raise ServiceError("over_quota", f"team {team}'s quota is {quota} GPU(s) and this run needs {need}: "
                                                 "an admin raises it, or the run asks for fewer")
            run_id = free_ids(spec.name, 1, lambda i: i in occupied or self._id_taken(i))[0]
            now = self.clock()
            group = self.group_factory(spec, run_id)
            controller = self._new_controller(spec, run_id, group, store, created_at=now)
            if occupied:
                controller.record(now, EventKind.RUN_ID_CHOSEN, run_id=run_id, name=spec.name,
                                      reason=f"{', '.join(occupied)} already hold checkpoints in {store.uri}: a "
                                             "submission starts a new run (goodput resume continues an old one)",
                                      occupied=occupied)
            seq = self.registry.add_run(run_id=run_id, name=spec.name, spec=spec.model_dump(mode="json"),
                                        state=controller.state.value, created_at=now, team=team)
            live = LiveRun(controller, seq, group, team=team)
            self._runs[run_id] = live
            self._save(live)
            return self._last_view(live)

    def runs(self) -> list[dict[str, Any]]:
        return [self._last_view(live) for live in sorted(self._runs.values(), key=lambda r: r.seq)]

    def run(self, run_id: str) -> dict[str, Any]:
        return self._last_view(self._live(run_id))

    def team_of(self, run_id: str) -> str:
        """The team a run belongs to (run_not_found when there is no such run)."""
        return self._live(run_id).team

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

    def spec(self, run_id: str) -> dict[str, Any]:
        """The run's spec as its controller holds it, less what the service asked of a provider."""
        return self._live(run_id).controller.spec.model_dump(mode="json", exclude={"model": {"numbers"}})

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
        self._live(run_id).reconcile_index(self.registry, self.RECONCILE_WAIT_S)
        return self.registry.checkpoints(run_id)

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
            spec = resume_spec(c.spec, run_id=run_id, at=c.progress.step, step=step, steps=steps, committed=committed)
            live.group = self.group_factory(spec, run_id)
            c.resume(self.clock(), step=step, steps=steps, spec=spec, worker_group=live.group,
                     injector=self._injector(live.group))
            self.registry.set_spec(run_id, spec.model_dump(mode="json"))
            live.admitted, live.closed, live.thread = False, False, None
            self._save(live)
            return self._view(live)

    def request_drill(self, run_id: str, kind: str, *, target: str | None, at_step: int | None,
                      **params: float | str | None) -> DrillRequest:
        live = self._live(run_id)
        with live.lock:
            c = live.controller
            if c.state.terminal:
                raise ServiceError("run_ended", f"run {run_id!r} has {c.state.value}; drills need a live run")
            drill_allowed(run_id, pending=len(c.drills.pending()), injected=c.events.count(EventKind.DRILL_INJECTED))
            try:
                request = c.request_drill(self.clock(), kind, target=target, at_step=at_step, **params)
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
        return self.nodes.table()

    def wait(self, run_id: str, *, timeout_s: float | None = None, on_tick: Callable[[RunController], None] | None = None,
             poll_s: float = 0.2) -> dict[str, Any]:
        """Block until the run ends (for `goodput run` and tests); on_tick sees the controller each poll."""
        self._live(run_id).wait_ended(timeout_s=timeout_s, on_tick=on_tick, poll_s=poll_s)
        return self.run(run_id)

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
        """Admit pending runs in the queue's order (service/scheduler.py: priority, the team's fair share,
        submission) while their plans fit the free nodes and their teams' quotas have room."""
        self.nodes.track(self._placed)
        self.nodes.settle_drains(self._in_use())
        with self.lock:
            queued = {live.seq: live for live in self._runs.values() if not live.admitted and not live.controller.state.terminal}
            if not queued:  # (nothing to ask the cluster or the registry about: this runs every poll)
                return
            quotas = team_quotas(self.registry)
            usable = self.nodes.usable()
            usage = self.usage()
            order = queue_order([self._queued(live, usable) for live in queued.values()], usage, quotas,
                                free_gpus(usable))
            blocked = False
            for q in order:
                live = queued[q.seq]
                c = live.controller
                if c.cancel_requested:
                    self._end(live, lambda: c.step(self.clock()))
                    continue
                if blocked:  # no overtaking
                    self._wait(live, BEHIND_EARLIER)
                    continue
                if (why := quota_problem(q, usage, quotas)) is not None:  # (holds back no other team)
                    self._wait(live, why)
                    continue
                free = self.nodes.free(usable)  # (the usable nodes read once a pass; what is free changes as runs start)
                verdict = live.admission(free, usable)
                if verdict.verdict is Verdict.REFUSE:
                    self._end(live, functools.partial(c.fail, self.clock(), "no_capacity", verdict.reason))
                    continue
                if verdict.verdict is Verdict.WAIT:
                    self._wait(live, self._preempt_for(live, q, free, usable) or verdict.reason)
                    blocked = True
                    continue
                self._admit(live, free, verdict.plan)
                usage[live.team] = usage.get(live.team, 0) + q.gpus

    def _preempt_for(self, live: LiveRun, q: Queued, free: Topology, usable: Topology) -> str | None:
        """A queued run that does not fit: stop the lower-priority runs whose nodes make it fit (the
        fewest GPUs), each at its next step boundary with that step committed; they go back to the
        queue. What it waits for then (None: no preemption helps, or one is under way)."""
        running = {other.seq: other for other in self._runs.values()
                   if other.admitted and not other.closed and other.controller.state is RunState.RUNNING
                   and other.controller.placement is not None}
        stopping = [other for other in running.values() if other.controller.stopping]
        if stopping:
            return f"waiting for capacity: {', '.join(o.controller.run_id for o in stopping)} stopping for it"
        candidates = tuple(Running(seq=other.seq, priority=PRIORITY_CLASSES[other.controller.spec.priority],
                                   gpus=len(other.controller.placement.node_of_rank),  # type: ignore[union-attr]
                                   nodes=frozenset(other.controller.placement.nodes()))  # type: ignore[union-attr]
                           for other in running.values() if PRIORITY_CLASSES[other.controller.spec.priority] < q.priority)
        if not candidates:
            return None
        key = (live.controller.spec, free, usable, candidates)  # (planned again only when one of them changes)
        if live.preemption is None or live.preemption[0] != key:
            live.preemption = (key, preemption_victims(live.controller.spec, q.priority, free, usable, list(candidates)))
        chosen = live.preemption[1]
        if not chosen:
            return None
        reason = f"preempted by {live.controller.run_id} (priority {live.controller.spec.priority})"
        asked = [running[seq].controller.run_id for seq in chosen if running[seq].controller.preempt(reason)]
        for seq in chosen:  # (its driver sends the stop now, not at its next poll)
            running[seq].wake.set()
        return f"waiting for capacity: preempting {', '.join(asked)}" if asked else None

    def usage(self) -> dict[str, int]:
        """GPUs each team's admitted runs hold now (their placements' ranks)."""
        held: dict[str, int] = {}
        for live in list(self._runs.values()):
            placement = live.controller.placement
            if live.admitted and not live.closed and not live.controller.state.terminal and placement is not None:
                held[live.team] = held.get(live.team, 0) + len(placement.node_of_rank)
        return held

    def teams_view(self) -> list[dict[str, Any]]:
        """Each team with its GPU quota, the GPUs its runs hold, its runs queued and the longest wait among
        them (goodput teams, /metrics)."""
        now = self.clock()
        held = self.usage()
        queued: dict[str, list[float]] = {}
        preempted: dict[str, int] = {}
        with self.lock:
            for live in self._runs.values():
                c = live.controller
                if not live.admitted and not c.state.terminal:
                    queued.setdefault(live.team, []).append(now - c.created_at)
                preempted[live.team] = preempted.get(live.team, 0) + c.events.count(EventKind.PREEMPTED)
        return [{**team, "gpus_held": held.get(team["name"], 0), "queued": len(queued.get(team["name"], [])),
                 "longest_wait_s": max(queued.get(team["name"], [0.0])), "preemptions": preempted.get(team["name"], 0)}
                for team in team_rows(self.registry)]

    def _queued(self, live: LiveRun, usable: Topology) -> Queued:
        spec = live.controller.spec
        return Queued(seq=live.seq, team=live.team, priority=PRIORITY_CLASSES[spec.priority],
                      gpus=live.requested_gpus(usable))

    def _end(self, live: LiveRun, how: Callable[[], Any]) -> None:
        """End a run that was never admitted (cancelled, refused): `how` ends its controller."""
        with live.lock:
            how()
        live.close()
        self._save(live)

    def _wait(self, live: LiveRun, reason: str) -> None:
        if live.controller.wait_for(reason):
            self._save(live)

    def _admit(self, live: LiveRun, free: Topology, plan: tuple[MeshPlan, Placement] | None) -> None:
        c = live.controller
        with live.lock:
            c.admit(free, plan)
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
            if state.terminal or not live.admitted:  # (preempted: the next admission starts another driver)
                return
            if state is RunState.RUNNING or state is before:
                live.wake.wait(self.poll_s)
                live.wake.clear()

    def advance(self, run_id: str, now: float | None = None) -> RunState:
        """One step of a run's controller, then persist it (what its driver thread repeats; tests call
        it directly on a service whose runs have no threads)."""
        live = self._live(run_id)
        c = live.controller
        try:
            with live.lock:
                state = c.step(self.clock() if now is None else now)
        except Exception as e:  # noqa: BLE001 - a controller bug is reported, and the run goes on by its policy
            if not self.reaches_cluster():  # not the run's fault: leave it for a service that does
                self.cluster_lost(f"{type(e).__name__}: {e}")
                return c.state
            state = self._controller_error(live, e)
        try:
            self._note_out_of_use(live)
            self._leave_draining(live)
            if state.terminal and not live.closed:
                live.close()
            if c.preempted and live.admitted:
                self._requeue(live)
        finally:
            try:
                self._save(live)
            except Exception as e:  # noqa: BLE001 - the run goes on; its stored view is one step older
                print(f"goodput: run {run_id}: saving its state failed: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        return state

    def _requeue(self, live: LiveRun) -> None:
        """A run preempted at a step boundary goes back to the queue: its workers (and GPUs) are
        released, and a fresh worker group waits for its next admission."""
        live.close()
        c = live.controller
        group = self.group_factory(c.spec, c.run_id)
        c.readmit(group, self.injector_factory(group) if self.injector_factory else None)
        live.group, live.closed, live.admitted = group, False, False

    def _controller_error(self, live: LiveRun, error: Exception) -> RunState:
        """A bug in a run's controller: its traceback goes to this service's log and the run's events,
        and the run goes on by its failure policy (RunController.controller_error). Only when handling
        it raises again does the run end, as `controller_error`, the traceback of both logged."""
        c = live.controller
        trace = traceback.format_exc()
        print(f"goodput: run {c.run_id}: controller error (a bug; the run goes on by its failure policy):\n{trace}",
              file=sys.stderr, flush=True)
        try:
            with live.lock:
                c.controller_error(self.clock(), error, trace)
        except Exception as again:  # noqa: BLE001 - the last resort: this run ends, the service goes on
            print(f"goodput: run {c.run_id}: handling the controller error failed too; the run ends:\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
            with live.lock:
                c.fail(self.clock(), "controller_error", f"{type(error).__name__}: {error}; then, handling it: "
                       f"{type(again).__name__}: {again}")
        return c.state

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

    def _own_view(self, run_id: str, within_s: float | None = None) -> Topology:
        """What the cluster shows of a run's own nodes (the controller merges back nodes it lost);
        `within_s`: Cluster.topology."""
        return self.nodes.of({n.name for n in self._runs[run_id].controller.topology.nodes}, within_s)

    def _placed(self) -> set[str]:
        """The nodes the live runs' placements use (as last saved)."""
        return {row["node"] for live in self._runs.values() if live.admitted and not live.closed and live.view is not None
                for row in live.view.get("placement") or []}

    def _note_out_of_use(self, live: LiveRun) -> None:
        """The nodes a run quarantined go out of use for every run (ServiceNodes.quarantine)."""
        self.nodes.quarantine(list(live.controller.quarantined), live.controller.run_id,
                              functools.partial(self._record, live))

    def _record(self, live: LiveRun, kind: EventKind, detail: dict[str, Any]) -> None:
        with live.lock:
            live.controller.record(self.clock(), kind, **detail)
        self._save(live)

    def _in_use(self) -> set[str]:
        """The nodes the live runs' ranks are on now, or are to be (a launch or a reseat in progress)."""
        with self.lock:
            return {n for live in self._runs.values() if live.admitted and not live.controller.state.terminal
                    and live.controller.placement is not None for n in live.controller.placement.nodes()}

    def _leave_draining(self, live: LiveRun) -> None:
        """A running run with ranks on a draining node is asked to stop at its next snapshot step and
        reseat them elsewhere (RunController.drain: asked again each step until it can be)."""
        c = live.controller
        draining = self.nodes.book.draining()
        if draining and c.state is RunState.RUNNING and c.placement is not None and not c.stopping:
            on = set(draining) & c.placement.nodes()
            if on and c.drain(on, f"drain of {', '.join(sorted(on))}"):
                print(f"goodput serve: run {c.run_id}: leaving {sorted(on)} at its next step boundary", file=sys.stderr,
                      flush=True)

    def drain_node(self, name: str, *, deadline: float | None, by: str) -> dict[str, Any]:
        """An operator's drain: no new rank on `name`; every run on it moves off at a step boundary
        (0 steps redone; nothing read from the store when its peers hold the step), then it is
        `drained` until released."""
        row = self.nodes.drain(name, deadline=deadline, by=by)
        on = [live for live in list(self._runs.values()) if live.controller.placement is not None
              and not live.controller.state.terminal and name in live.controller.placement.nodes()]
        for live in on:  # asked now, not at its next poll (its driver wakes to send the stop at once)
            self._leave_draining(live)
            live.wake.set()
        return {**row, "runs": sorted(live.controller.run_id for live in on)}

    def release_node(self, name: str) -> dict[str, Any]:
        """An operator's explicit release of a quarantined node: usable by new runs again. Runs that
        quarantined it keep it out of their own topology."""
        with self.lock:
            when = [q["time"] for live in self._runs.values() for q in list(live.controller.quarantined) if q["node"] == name]
        return self.nodes.release(name, when)

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
        return live.render(self.clock() if now is None else now)

    def _restore(self) -> None:
        """Build every run of the registry again and carry it on (service/restore.py says how)."""
        now = self.clock()
        for row in self.registry.run_rows():
            run_id = row["id"]
            spec = parse_spec(row["spec"])
            group = self.group_factory(spec, run_id)
            try:
                store, _ = run_store(spec, self.store_factory)
            except ServiceError:
                store = None
            c = self._new_controller(spec, run_id, group, store, created_at=row["created_at"])
            events = self.registry.all_events(run_id)
            c.restore(events=events, history=self.registry.history(run_id))
            live = LiveRun(c, int(row["seq"]), group, team=row.get("team") or DEFAULT_TEAM)
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

    def _new_controller(self, spec: RunSpec, run_id: str, group: WorkerGroup, store: Any, *,
                        created_at: float) -> RunController:
        spec = with_model_numbers(spec)  # a registry's spec holds what the user wrote, not the numbers
        c = RunController(spec, self.nodes.usable(), group, now=created_at, checkpoint_store=store, run_id=run_id,
                          injector=self._injector(group), topology_source=functools.partial(self._own_view, run_id),
                          own_checkpoints_only=self.accept_submissions)
        # a shared service may preempt it or drain a node under it (`goodput run`'s one run: never)
        c.stoppable = self.accept_submissions
        return c

    def _injector(self, group: WorkerGroup) -> DrillInjector | None:
        return self.injector_factory(group) if self.injector_factory is not None else None

    def _id_taken(self, run_id: str) -> bool:
        return run_id in self._runs or self.registry.has_run(run_id)
