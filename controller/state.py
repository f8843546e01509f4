"""The run controller: an explicit state machine advanced one step per `step(now)` call.

pending -> planning -> launching -> running -> succeeded | failed | cancelled
A failure while running is attributed (controller.attribution), handed to the failure policy, and
the decision acted on: back to launching with a new mesh/placement (a new attempt), or recovering
while it waits for capacity, or failed.

Plain Python: the worker group is injected (Ray in production, a fake in tests) and time is passed
in. The controller decides; the worker group only does what it is told.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterable, Mapping

from checkpointing.manifest import ForeignCheckpoints, IdentityMismatch
from checkpointing.peer import Held
from checkpointing.store import ObjectStore, StoreError
from controller.attempt import AttemptSpec, GroupStatus, WorkerGroup
from controller.boundary_stop import BoundaryStop, EndedStop
from controller.checkpoints import LoadPoint, RunCheckpoints
from controller.errors import ClusterSilent
from controller.events import EventKind, EventLog
from controller.placement import Placement, place
from controller.planner import MeshPlan, memory_problem, plan_run
from controller.progress import RunProgress
from controller.replicas import ReplicaDomain
from controller.run_drills import RunDrills
from controller.spec import RunSpec, SpecError
from controller.attribution import AttemptWatch, StragglerWatch, failures_from, quarantines_from, relaunch_failure
from controller.drills import DrillError, DrillInjector, DrillKind, DrillRequest, domain_problem
from controller.failure_policy import (
    Action, Decision, ElasticLimits, FailureCause, FailureEvent, GrowWatch, RunPolicy, taken_out,
)
from controller.run_state import RunError, RunState
from controller.topology import Node, NodeState, Topology, TopologySource, merge_returned
from controller.user_errors import Judgement, Raised, elsewhere, judge, raised
from controller.views import GoodputView, health_view, run_view
from trainer.config import MeshShape, TrainerConfig


WARM_SPARES_EVERY_S = 5.0
"""How often a running attempt looks for spares without warm workers (`RunController._warm_spares`)."""
BY_THE_WAY_WAIT_S = 1.0
"""How long a running attempt's reads of the cluster by the way (spares to warm, nodes back to grow
onto or to form a replica on) wait for its answer. A controller cut off from the cluster goes on
polling, and its heartbeats tell it so; a read that waited for the cut to end would hide it."""


class RunController:
    def __init__(self, spec: RunSpec, topology: Topology, worker_group: WorkerGroup, *, now: float,
                 checkpoint_store: ObjectStore | None = None, run_id: str | None = None,
                 injector: DrillInjector | None = None,
                 topology_source: TopologySource | None = None,
                 own_checkpoints_only: bool = False) -> None:
        self.spec = spec
        self.run_id = run_id or spec.name
        self._topology = topology.with_racks(spec.cluster.racks)
        self.worker_group = worker_group
        self.checkpoints = RunCheckpoints(self.run_id, checkpoint_store, retry_budget_s=spec.checkpoint.retry_budget_s,
                                          created_at=now, own_only=own_checkpoints_only)
        self.state = RunState.PENDING
        self.attempt = -1
        self.plan: MeshPlan | None = None
        self.placement: Placement | None = None
        self.config: TrainerConfig | None = None
        self.error: RunError | None = None
        self.created_at = now
        self.finished_at: float | None = None
        self.events = EventLog(self.run_id)
        self.progress = RunProgress()
        self._attempt_started_at = now
        self._cancel_requested = False
        self.injector = injector
        self._grow = GrowWatch()
        self.policy = self._policy()
        """The spec's decisions (failure_policy.RunPolicy); built again when a resume changes the spec."""
        self._goodput = GoodputView()
        self._left: set[str] = set()
        """Nodes this run was drained off: it never takes them back (a service's release offers them to new runs)."""
        self.topology_source = None if topology_source is None else functools.partial(self._without_left, topology_source)
        self.drills = RunDrills(self.run_id, spec.drills)
        self.failures: list[FailureEvent] = []
        self._raised: Raised | None = None
        """The exception a worker error first raised, and where: the same at the same step from other
        nodes is the user's code (controller/user_errors.py)."""
        self._raised_failure: FailureEvent | None = None
        """The failure it was raised in (charged unless the second raising shows it was the user's code)."""
        self._boundary = BoundaryStop()
        """A stop at a step boundary (a preemption, a drain, a SIGTERM) asked of the running attempt."""
        self._replica_departure: tuple[tuple[str, ...], str] | None = None
        """failure_domain replica: (nodes, reason) of a drain, until the driving thread takes their replicas out."""
        self.preempted = False
        """Stopped for another run, its state kept: back in a service's queue until admitted again."""
        self.stoppable = False
        """A service that may preempt it says so before its launch (its ranks then look for a stop at
        every step boundary)."""
        self.quarantined: list[dict[str, Any]] = []
        """Nodes taken out of the run for good: {node, reason, evidence, time}."""
        self.stragglers: StragglerWatch | None = None
        self._waiting_since: float | None = None
        self._last_failure: FailureEvent | None = None
        self.waiting_for: str | None = None
        """Why a submitted run has not started (set by the service that queues it)."""
        self._admitted_plan: tuple[MeshPlan, Placement] | None = None
        """The plan a service admitted the run with (used by the next planning step, then dropped)."""
        self.outside_lock: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        """Entered around every slow call: store I/O, launch, shutdown, drill injection. A service that
        drives this controller under a lock releases it here, so its requests never wait behind I/O
        (only the driving thread changes the run's state; requests only set flags and queue drills)."""
        self.watch: AttemptWatch | None = None
        """The attempt being driven, as watched (None before the first launch)."""
        self.replicas = self._replica_domain()
        """failure_domain replica: the replicas of this attempt that are out, and their way back in."""
        self._isolated: str | None = None
        """Why the worker group last said this controller suspects itself (PollResult.isolated)."""
        self.warmed_at = float("-inf")
        """When the running attempt last looked for spares to warm workers on (`_warm_spares`)."""
        self.events.add(now, 0, EventKind.SUBMITTED, name=spec.name)

    def _without_left(self, source: TopologySource, within_s: float | None = None) -> Topology:
        """What the cluster shows, less the nodes this run was drained off."""
        shown = source(within_s)
        return Topology(tuple(n for n in shown.nodes if n.name not in self._left)) if self._left else shown

    def _shown_by_the_way(self) -> Topology | None:
        """What the cluster shows now, for what a running attempt does by the way; None when there is no
        source, or it does not answer within BY_THE_WAY_WAIT_S (nothing is done this time)."""
        if self.topology_source is None:
            return None
        try:
            return self.topology_source(BY_THE_WAY_WAIT_S)
        except ClusterSilent:
            return None

    @property
    def isolated(self) -> str | None:
        """Why this controller suspects itself (it hears no node of its running attempt), or None."""
        return self._isolated if self.state is RunState.RUNNING else None

    @property
    def replicas_out(self) -> dict[int, tuple[str, ...]]:
        """failure_domain replica: the data-parallel replicas of this attempt not training now, and
        the nodes each lost (to be replaced before it can be formed again). Read only."""
        return self.replicas.out

    def _replica_domain(self) -> ReplicaDomain:
        # (the lock is read at each call: a service sets `outside_lock` after construction)
        return ReplicaDomain(self.events, self.worker_group, self.spec.elastic, lambda: self.outside_lock())

    @property
    def topology(self) -> Topology:
        """The nodes this run may use, with the spec's `cluster.racks` over the cluster's racks."""
        return self._topology

    @topology.setter
    def topology(self, topology: Topology) -> None:
        self._topology = topology.with_racks(self.spec.cluster.racks)

    # -- the machine -----------------------------------------------------------------------------
    def step(self, now: float) -> RunState:
        """Advance at most one transition (or absorb one poll while running)."""
        if self.state.terminal:
            return self.state
        if self._cancel_requested:
            self._shutdown()
            self._finish(now, RunState.CANCELLED)
            return self.state
        getattr(self, f"_on_{self.state.value}")(now)  # _on_pending, _on_planning, ... _on_recovering
        return self.state

    def preempt(self, reason: str) -> bool:
        """Safe from any thread: ask the running attempt's ranks to stop after their next step with it
        committed to the store (trainer/stop.py), then go back to the queue (`preempted`); not a failure.
        False when it cannot be asked now: not running, failure_domain replica (its replicas would have
        to agree on the step: not yet), no checkpoint store, or a worker group that cannot stop."""
        if (not self.stoppable or self.state is not RunState.RUNNING or self.spec.elastic.failure_domain != "world"
                or self.checkpoints.store is None or getattr(self.worker_group, "request_stop", None) is None):
            return False
        return self._boundary.ask("store", reason)

    def drain(self, nodes: Iterable[str], reason: str) -> bool:
        """Safe from any thread: `nodes` must go (an operator's drain, a node tainted for deletion or
        spot reclaim, a SIGTERM). The running attempt's ranks stop after their next peer snapshot step
        (the store's checkpoint when the run keeps no peer snapshots), then their ranks there are
        reseated elsewhere (a spare, else a smaller mesh) and the run goes on from that step: nothing
        redone, nothing read from the store when its peers hold it, nothing charged. failure_domain
        replica: the replicas on them leave instead (`_leave_by_replicas`). False when it cannot be
        asked now: not running, none of its ranks there, nothing that could keep the state, a worker
        group that cannot stop, or a stop (or a replica departure) already asked."""
        on = sorted(set(nodes) & self.placement.nodes()) if self.placement is not None else []
        if not on or self.state is not RunState.RUNNING or self._boundary.pending:
            return False
        if self.config is not None and self._domain(self.config.mesh) == "replica":
            if self._replica_departure is not None:
                return False
            self._replica_departure = (tuple(on), reason)  # (acted on by the driving thread: _leave_by_replicas)
            return True
        keeps = self.spec.checkpoint.peer_every_steps > 0 or self.checkpoints.store is not None
        if (not self.stoppable or not keeps or self.spec.elastic.failure_domain != "world"
                or getattr(self.worker_group, "request_stop", None) is None):
            return False
        return self._boundary.ask("peers", reason, departing=tuple(on))

    def _leave_by_replicas(self, now: float) -> None:
        """failure_domain replica: the replicas with ranks on the departing nodes stop (the others train
        on) and form again elsewhere from a live replica's memory, as after their loss but charged
        nothing; the step in flight of the survivors may be done again (their collectives with the
        leaving replicas fail). A departure the domain cannot contain (the last live replica) waits."""
        assert self._replica_departure is not None and self.config is not None and self.placement is not None
        assert self.watch is not None
        nodes, reason = self._replica_departure
        departure = FailureEvent(time=now, cause=FailureCause.DRAINED, nodes=nodes, message=reason)
        held = self.replicas.contains(departure, mesh=self.config.mesh, placement=self.placement,
                                      failures=len(self.failures))
        if held is None:
            return  # (looked at again at the next poll)
        self._replica_departure = None
        if not held.lost:
            return  # (its replicas are out already, to form again elsewhere)
        self.events.add(now, self.attempt, EventKind.DRAINED, nodes=list(nodes), step=self.progress.step,
                        kept="replicas", replicas=list(held.lost), reason=reason)
        self._left.update(nodes)
        self.topology = self.topology.with_states({n: NodeState.LOST for n in nodes})
        self.replicas.take_out(now, departure, held, attempt=self.attempt, mesh=self.config.mesh,
                               placement=self.placement, watch=self.watch)
        self._form_replicas(now)

    def cancel(self) -> None:
        """Safe from any thread: the next step cancels; a launch in progress gives up first."""
        self._cancel_requested = True
        abort = getattr(self.worker_group, "abort", None)
        if abort is not None and self.state is RunState.LAUNCHING:
            abort()

    def _shutdown(self) -> None:
        with self.outside_lock():
            self.worker_group.shutdown()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def fail(self, now: float, code: str, message: str) -> None:
        """End a run that has not ended from outside the machine (a service that cannot place it)."""
        if not self.state.terminal:
            self._shutdown()
            self._fail(now, code, message)

    def controller_error(self, now: float, error: BaseException, trace: str) -> None:
        """An exception inside this controller (a bug to report, never a verdict on the run): it joins
        the timeline with its traceback, the attempt it may have left half-handled ends, and the failure
        policy decides as for any failure with no node to blame (a restart on the same placement,
        charged to elastic.max_failures, so a bug that repeats ends the run by its budget)."""
        message = f"{type(error).__name__}: {error}"
        self.events.add(now, max(self.attempt, 0), EventKind.CONTROLLER_ERROR, message=message, traceback=trace,
                        state=self.state.value)
        failure = FailureEvent(time=now, cause=FailureCause.CONTROLLER_ERROR, message=message)
        if self.config is None or self.state in (RunState.PENDING, RunState.PLANNING):
            self.failures.append(failure)  # nothing launched: plan again, within the same budget
            if len(self.failures) > self.spec.elastic.max_failures:
                self._fail(now, "failure_budget", f"{len(self.failures)} failures exceed elastic.max_failures = "
                           f"{self.spec.elastic.max_failures} (the last: controller error {message})")
            else:
                self.state = RunState.PLANNING
            return
        self._recover(now, failure, contain=False)

    def record(self, now: float, kind: EventKind, **detail: Any) -> None:
        """An event from outside the machine (the service's restarts, a node's cordon) in the timeline."""
        self.events.add(now, max(self.attempt, 0), kind, **detail)

    def admit(self, free: Topology, plan: tuple[MeshPlan, Placement] | None = None) -> None:
        """A service admits the run onto these free nodes with the plan it made on them (None: the run
        plans on them itself); then it `confine`s itself."""
        used = set(plan[1].nodes_used()) if plan is not None else set()  # (spares a resume took: in use now)
        self.topology = free.with_states({n.name: NodeState.HEALTHY for n in free.spares() if n.name in used})
        self.waiting_for = None
        self._admitted_plan = plan

    def wait_for(self, reason: str) -> bool:
        """Queued by a service for `reason` (shown in the Run object); True when the reason changed."""
        changed, self.waiting_for = self.waiting_for != reason, reason
        return changed

    def ended_as(self, state: RunState, finished_at: float | None, error: RunError | None) -> None:
        """A restored run that had already ended (the registry says how)."""
        assert state.terminal
        self.state, self.finished_at, self.error = state, finished_at, error

    def confine(self, nodes: set[str]) -> None:
        """This run may use only these nodes from now on (a service shares its cluster among runs)."""
        self.topology = Topology(tuple(n for n in self.topology.nodes if n.name in nodes))

    def restore(self, *, events: list[dict[str, Any]], history: list[dict[str, Any]]) -> None:
        """Carry on a run a previous controller drove (a restarted service): its timeline, progress,
        and what the timeline implies: the attempt count, the nodes it quarantined, its failures (they
        count against max_failures) and the drills it still has to inject."""
        self.events.restore(events)
        self.progress.restore(history)
        self.checkpoints.restore(events)
        self.attempt = max((e["attempt"] for e in events if e["kind"] == EventKind.ATTEMPT_STARTED), default=-1)
        self.quarantined = quarantines_from(events)
        self.failures = failures_from(events)
        self.drills.restore(events)

    def adopt(self, now: float, attempt: AttemptSpec, replicas_out: dict[int, tuple[str, ...]] | None = None) -> None:
        """Go on driving an attempt whose workers run on (a restarted service re-attached to them);
        `replicas_out`: replicas it lost and had not formed again (replica -> the nodes they lost),
        formed again from here as after any loss."""
        self.attempt = attempt.attempt
        self.placement = attempt.placement
        self.config = attempt.config
        self.progress.committed = attempt.start_step
        self._track_attempt(now)
        if replicas_out:
            lost, ranks = self.replicas.adopt(replicas_out, attempt.placement.mesh)
            self.topology = self._known_lost(lost, attempt.placement)
            assert self.watch is not None
            self.watch.contained(ranks)
        self.state = RunState.RUNNING

    def _known_lost(self, lost: set[str], placement: Placement) -> Topology:
        """The topology with `lost` (nodes of `placement`) as LOST, listed if the cluster no longer
        shows them: a node back from repair under its name is then seen as returned (merge_returned)."""
        missing = sorted(n for n in lost if n not in self.topology)
        if missing:
            ranks = collections.Counter(placement.node_of_rank)
            memory = self.topology.smallest_gpu_bytes
            self.topology = Topology(self.topology.nodes + tuple(
                Node(name=n, rack=placement.rack_of_node.get(n, ""), num_gpus=ranks[n], gpu_memory_bytes=memory,
                     state=NodeState.LOST) for n in missing))
        return self.topology.with_states({n: NodeState.LOST for n in lost})

    def _track_attempt(self, now: float) -> None:
        """Fresh per-attempt bookkeeping: failure signals, progress timestamps, straggler scores."""
        assert self.config is not None and self.placement is not None
        self._attempt_started_at = now
        self.replicas.reset()
        h = self.spec.health
        self.watch = AttemptWatch(self.attempt, self.config.mesh, self.placement.node_of_rank,
                                  last_step=self.spec.train.steps, straggler_ratio=h.straggler_ratio,
                                  straggler_steps=h.straggler_steps, straggler_action=h.straggler_action,
                                  hang_factor=h.hang_factor, hang_floor_s=h.hang_floor_s)
        self.stragglers = self.watch.stragglers

    def resume(self, now: float, *, step: int | None, steps: int | None, spec: RunSpec, worker_group: WorkerGroup,
               injector: DrillInjector | None) -> None:
        """Start an ended run again (a new attempt, on a fresh worker group) from its latest or the given
        committed step."""
        assert self.state.terminal
        self.spec = spec
        self.worker_group, self.injector = worker_group, injector
        self.policy = self._policy()
        self.replicas = self._replica_domain()
        self.checkpoints.discards.resume_to(step)
        if step is not None:  # back to an older step: no newer snapshot of an earlier attempt either
            for attempt in range(self.attempt + 1):
                self.checkpoints.exclude_peers(attempt, step)
        self._cancel_requested = False
        self.error = None
        self._raised, self._raised_failure = None, None  # (the code may have been fixed)
        self.finished_at = None
        self.state = RunState.PENDING
        self.checkpoints.adopted = True
        self.events.add(now, max(self.attempt, 0), EventKind.RESUME_REQUESTED, step=step, steps=spec.train.steps)

    def _on_pending(self, now: float) -> None:
        if self.preempted:  # (queued again: planned once a service admits it, `readmit`)
            return
        self.state = RunState.PLANNING

    def _on_planning(self, now: float) -> None:
        if self.spec.elastic.failure_domain == "replica" and getattr(self.worker_group, "lose_replicas", None) is None:
            self._fail(now, "unsupported", "elastic.failure_domain: replica needs a worker group that can go on without "
                       f"a replica; {type(self.worker_group).__name__} cannot yet (the trainer's side is "
                       "trainer/replica.py; `goodput simulate` models it): use failure_domain: world")
            return
        try:
            self.plan, self.placement = self._admitted_plan or plan_run(self.spec, self.topology)
            self._admitted_plan = None
        except SpecError as e:
            self._fail(now, "plan_infeasible", str(e))
            return
        self.config = self.spec.trainer_config(self.plan.mesh)
        mesh = self.plan.mesh
        self.events.add(now, 0, EventKind.PLANNED, mesh=mesh.axes(),
                        memory_per_gpu_bytes=self.plan.memory_per_gpu_bytes, explanation=self.plan.explanation)
        self.state = RunState.LAUNCHING

    def _domain(self, mesh: MeshShape) -> str:
        """The failure domain an attempt on `mesh` has: the spec's, where the mesh has several replicas."""
        return self.spec.elastic.failure_domain if mesh.dp_replicas > 1 else "world"

    # -- launching an attempt: where it starts (a committed step or a peer snapshot step,
    # controller/checkpoints.py), what its AttemptSpec says, the launch, and `attempt_started`
    def attempt_spec(self, now: float, config: TrainerConfig, placement: Placement, point: LoadPoint) -> AttemptSpec:
        """The AttemptSpec of attempt `self.attempt` on `placement`, starting where `point` says (a
        restarted service builds the one it re-attaches to the same way: controller/service/restore.py)."""
        domain = self._domain(placement.mesh)
        return AttemptSpec(
            run_id=self.run_id, attempt=self.attempt, config=config, placement=placement,
            start_step=point.start_step, cursor=point.cursor, resume_step=point.resume_step,
            **self.checkpoints.attempt_settings(self.spec, run_s=now - self.created_at, failures=len(self.failures)),
            **self.checkpoints.peer_settings(self.spec, placement, point, replicas=domain == "replica"),
            failure_domain=domain, batch_while_healing=self.spec.elastic.batch_while_healing,
            stoppable=self.stoppable and domain == "world" and (
                self.checkpoints.store is not None or self.spec.checkpoint.peer_every_steps > 0))

    def _on_launching(self, now: float) -> None:
        """Start the next attempt where its checkpoints say (once the store answers), or end the run."""
        assert self.config is not None and self.placement is not None
        if not self.checkpoints.outage.due(now):
            return
        point = self._load_point(now)
        if point is None or self._cancel_requested:
            return  # (the store is out, or the run failed; a cancel: the next step cancels)
        self.attempt += 1
        for reason in point.unusable:
            self.events.add(now, self.attempt, EventKind.CHECKPOINT_UNUSABLE, reason=reason)
        unheard = self.progress.add_unheard(point.peer.reports) if point.peer is not None else []
        attempt = self.attempt_spec(now, self.config, self.placement, point)
        self._track_attempt(now)
        try:
            with self.outside_lock():
                self.worker_group.start(attempt)
        except Exception as e:  # noqa: BLE001 - any launch failure ends the attempt with its reason
            self._shutdown()
            if not self._cancel_requested:  # (one that gave up because of the cancel: the next step cancels)
                self._launch_failed(now, f"{type(e).__name__}: {e}")
            return
        mesh = self.config.mesh
        self.events.add(now, self.attempt, EventKind.ATTEMPT_STARTED,
                        mesh=mesh.axes(), dp_replicas=mesh.dp_replicas,
                        placement=self.placement.columns(), spares=list(self.placement.spares),
                        start_step=point.start_step, resume_step=point.resume_step, cursor=point.cursor,
                        restore_from=point.source, **({"reports_from_snapshot": unheard} if unheard else {}),
                        **({"peer_replicas": list(point.peer_replicas)} if point.peer_replicas is not None else {}),
                        **({"peer_unusable": point.peer_unusable} if point.peer_unusable and self.attempt > 0 else {}))
        self.progress.committed = point.start_step
        if point.start_step >= self.spec.train.steps:
            self._shutdown()
            self._finish(now, RunState.SUCCEEDED, step=point.start_step)
            return
        self.state = RunState.RUNNING

    def _load_point(self, now: float) -> LoadPoint | None:
        """Where the next attempt starts, its fence raised before any of its ranks can commit; None when
        the store does not answer (backed off; past `checkpoint.retry_budget_s` the timeline says so,
        once) or its checkpoints are not this run's (the run fails)."""
        assert self.config is not None and self.placement is not None
        by_replica = self._domain(self.config.mesh) == "replica"
        try:
            with self.outside_lock():
                nodes = self.placement.nodes()
                point = self.checkpoints.load_point(
                    self.spec, self._peer_copies(nodes), nodes,
                    replica_nodes=self.placement.replica_nodes() if by_replica else None)
                self.checkpoints.raise_fence(self.attempt + 1, point.start_step)
        except StoreError as e:
            if (detail := self.checkpoints.unreachable(now, e)) is not None:
                self.events.add(now, max(self.attempt, 0), EventKind.STORE_UNAVAILABLE, **detail)
            return None
        except (IdentityMismatch, ForeignCheckpoints) as e:
            self._fail(now, "checkpoint_mismatch" if isinstance(e, IdentityMismatch) else "checkpoints_in_the_way", str(e))
            return None
        self._discarded(now, point.discarded)
        if (down := self.checkpoints.outage.answered(now)) is not None:
            self.events.add(now, max(self.attempt, 0), EventKind.STORE_AVAILABLE, down_s=down)
        return point

    def _warm_spares(self, now: float) -> None:
        """Spares the cluster gives this run that its worker group has no warm workers on (a node back
        from repair refills the spare pool after the launch, and a group's first launch leaves its spares
        to this) get them now, not on the next recovery's path (controller/ray/worker_group.py,
        `prewarm`). Only once the attempt has finished a step: on 2 cores their start would otherwise
        slow the attempt's own first step."""
        prewarm = getattr(self.worker_group, "prewarm", None)
        if prewarm is None or self.topology_source is None or now - self.warmed_at < WARM_SPARES_EVERY_S:
            return
        if not self.progress.has_stepped(self.attempt):
            return
        self.warmed_at = now
        with self.outside_lock():
            if (shown := self._shown_by_the_way()) is None:
                return
            try:
                prewarm([n.name for n in shown.spares()])
            except ClusterSilent:  # (the worker group asks which are alive: by the way too)
                return

    def _peer_copies(self, nodes: set[str]) -> Mapping[str, list[Held]] | None:
        """What peer snapshot copies the next attempt's nodes hold (None: peer snapshots are off, or
        the worker group cannot say; a node that does not answer holds nothing usable)."""
        ask = getattr(self.worker_group, "peer_copies", None)
        if not self.spec.checkpoint.peer_every_steps or ask is None:
            return None
        return ask(self.checkpoints.peer_key, nodes)

    def _discarded(self, now: float, discarded: list[tuple[int, str]]) -> None:
        for step, reason in discarded:
            self.events.add(now, self.attempt, EventKind.CHECKPOINT_DISCARDED, step=step, reason=reason)

    def _launch_failed(self, now: float, message: str) -> None:
        """A first launch that fails ends the run; a relaunch during recovery is one more failure."""
        if self.attempt == 0 or self.topology_source is None:
            self._fail(now, "launch_failed", message)
            return
        assert self.placement is not None
        live = {n.name for n in self.topology_source().nodes}
        # Never contained: an attempt that did not start has no replicas that could go on without others.
        self._recover(now, relaunch_failure(now, message, self.placement.node_of_rank, live), contain=False)

    def _on_running(self, now: float) -> None:
        assert self.watch is not None
        if self._replica_departure is not None:
            self._leave_by_replicas(now)
        if (asked := self._boundary.to_send()) is not None:
            keep, reason = asked
            with self.outside_lock():
                self.worker_group.request_stop(keep, reason)  # type: ignore[attr-defined]
            self.events.add(now, self.attempt, EventKind.STOP_REQUESTED, keep=keep, reason=reason,
                            step=self.progress.step)
        with self.outside_lock():
            result = self.worker_group.poll()
        if result.isolated != self._isolated:  # (said when it begins and when it ends)
            self.events.add(now, self.attempt, EventKind.CONTROLLER_ISOLATED, isolated=result.isolated is not None,
                            message=result.isolated or "heartbeats heard again")
            self._isolated = result.isolated
        if result.isolated is not None:
            return  # it hears no node: it judges none (what it missed arrives once it hears them again)
        self._warm_spares(now)
        seen = self.watch.fold(now, result, self.progress)
        if seen.first_step is not None and self.attempt > 0:
            # When the ranks finished it (a report may reach us later than that: a peer snapshot's is
            # held until the copy is on the buddies), never after we heard of it.
            ended = next((h.get("end") for h in reversed(self.progress.history)
                          if (h["step"], h["attempt"]) == (seen.first_step, self.attempt)), None)
            self.events.add(now, self.attempt, EventKind.FIRST_STEP_AFTER_RECOVERY, step=seen.first_step,
                            ended_at=min(ended, now) if ended is not None else now)
        for detail in seen.stragglers:
            self.events.add(now, self.attempt, EventKind.STRAGGLER, **detail)
        for rank, kind, detail in result.events:  # every event of the poll joins the timeline first
            # (a rejoin records where its replica now runs: a restarted service re-attaches there)
            moved = {"placement": self.placement.columns()} if kind == EventKind.REPLICA_REJOINED and self.placement else {}
            said_by = {"rank": rank} if rank >= 0 else {}  # (rank -1: the worker group's own word)
            self.events.add(now, self.attempt, kind, **{**detail, **said_by, **moved})  # the reporting rank wins
            if kind == EventKind.REPLICA_REJOINED:
                self.replicas.rejoined(detail.get("replicas", ()))
            if kind == EventKind.REPLICA_RESYNC:
                self.replicas.resynced(now)  # (its first step after: the survivors' stall ends)
            if kind == EventKind.STOPPED_AT_BOUNDARY:
                self._boundary.heard(detail)
            if kind == EventKind.TERMINATING and rank >= 0 and self.placement is not None:
                self._boundary.sigterm(self.placement.node_of_rank[rank])
        self.replicas.survivors_stepped(now, self.attempt, result.reports)
        if self.replicas_out and seen.failure is None:
            self._form_replicas(now)
        if seen.interval is not None:
            self.checkpoints.auto_interval = seen.interval
        sdc = seen.failure is not None and seen.failure.cause is FailureCause.SDC
        if seen.committed and not sdc and (self._maybe_replace_stragglers(now) or self._maybe_grow(now)):
            return
        if seen.failure is not None:
            self._recover(now, seen.failure)
        elif result.status is GroupStatus.FINISHED and self.watch.signals.since is None and \
                self._boundary.carried_out(step=self.progress.step, last_step=self.spec.train.steps):
            self._shutdown()
            stop = self._boundary.end(self.progress.step)
            if stop.departing:
                self._reseat_departing(now, stop)
            else:
                self._stopped_at_boundary(now, stop)
        elif result.status is GroupStatus.FINISHED and self.watch.signals.since is None:
            self._shutdown()
            failure = self.watch.finished(now)
            if failure is not None:
                self._recover(now, failure)
                return
            self._finish(now, RunState.SUCCEEDED, step=self.progress.step)
        else:
            self._run_due_drills(now)

    def _stopped_at_boundary(self, now: float, stop: EndedStop) -> None:
        """Every rank stopped after the same step as asked, that step committed: the attempt ends, not
        as a failure (nothing charged to elastic.max_failures), and the run waits to be admitted again
        (a service re-queues it; the next attempt loads that step)."""
        self.events.add(now, self.attempt, EventKind.PREEMPTED, step=stop.step, kept=stop.kept, reason=stop.reason)
        self.preempted = True
        self.waiting_for = f"{stop.reason}: back in the queue from step {stop.step}"
        self.state = RunState.PENDING

    def _reseat_departing(self, now: float, stop: EndedStop) -> None:
        """Every rank stopped after the same step, its state kept (on its buddies, for the departing
        nodes' ranks): the next attempt starts at once from that step without those nodes, decided as
        after their loss but charged nothing."""
        assert self.config is not None
        nodes = stop.departing
        self.events.add(now, self.attempt, EventKind.DRAINED, nodes=list(nodes), step=stop.step, kept=stop.kept,
                        reason=stop.reason)
        departure = FailureEvent(time=now, cause=FailureCause.DRAINED, nodes=nodes, message=stop.reason)
        self._left.update(nodes)
        self._last_failure = departure
        self._apply(now, self.policy.on_failure(now, departure, failures_so_far=len(self.failures), mesh=self.config.mesh,
                                                topology=self.topology, waiting_since=self._waiting_since,
                                                placement=self.placement))

    @property
    def user_error_retried(self) -> bool:
        """A worker error was retried on other nodes once (its second raising there ends the run)."""
        return self._raised is not None

    @property
    def stopping(self) -> bool:
        """A stop at a step boundary was asked and the ranks have not stopped yet."""
        return self._boundary.pending

    def readmit(self, worker_group: WorkerGroup, injector: DrillInjector | None) -> None:
        """A preempted run's service gives it a fresh worker group before admitting it again."""
        self.worker_group, self.injector = worker_group, injector
        self.preempted = False

    def acts_on_commits(self) -> bool:
        """Whether a commit may make the controller act now: grow back a shrunk mesh, or replace a
        straggler it judged (a driver that wakes for events may skip commits otherwise)."""
        return (self.config is not None and self.policy.may_grow(self.config.mesh)) or \
            (self.watch is not None and bool(self.watch.stragglers.to_replace))

    def _maybe_replace_stragglers(self, now: float) -> bool:
        """At a checkpoint (no step is lost): replace the ranks judged slower than their peers, if a spare exists."""
        assert self.watch is not None
        if not self.watch.stragglers.to_replace:
            return False
        failure = self.watch.stragglers.replacement(now, spare=bool(self.topology.spares()), step=self.progress.step)
        if failure is not None:
            self._recover(now, failure)
        return failure is not None

    def _contain(self, now: float, failure: FailureEvent) -> bool:
        """failure_domain replica: a failure that stops only the replicas it touched (ReplicaDomain.contains)
        is recorded and they are taken out; the survivors go on, the lost ones form again on spares.
        False: stop the world."""
        assert self.config is not None and self.placement is not None and self.watch is not None
        mesh = self.config.mesh
        held = self.replicas.contains(failure, mesh=mesh, placement=self.placement, failures=len(self.failures))
        if held is None:
            return False
        if not held.lost:  # news of replicas already out: nothing more stops
            self.watch.contained(set(held.ranks))
            return True
        self._detected(now, failure, replicas=list(held.lost))
        self.failures.append(failure)
        state = NodeState.QUARANTINED if failure.cause.quarantines else NodeState.LOST
        self.topology = self.topology.with_states({n: state for n in failure.nodes})
        if failure.cause.quarantines:
            self._quarantine_contained(now, failure)
        self.replicas.take_out(now, failure, held, attempt=self.attempt, mesh=mesh, placement=self.placement,
                               watch=self.watch)
        self._form_replicas(now)
        return True

    def _quarantine_contained(self, now: float, failure: FailureEvent) -> None:
        """A contained SDC: its nodes get no rank again (the replica forms on others), and commits
        after the last step the replicas agreed on are not loaded again (the suspect may have saved)."""
        for node in failure.nodes:
            detail = {"node": node, "reason": failure.cause.value, "ranks": list(failure.ranks),
                      "message": failure.message, "evidence": dict(failure.evidence)}
            self.events.add(now, self.attempt, EventKind.QUARANTINED, **detail)
            self.quarantined.append({"node": node, "reason": detail["reason"], "evidence": detail["evidence"],
                                     "time": now})
        through = self.watch.take_rollback() if self.watch is not None else None
        if through is not None:
            with self.outside_lock():
                self._discarded(now, self.checkpoints.roll_back(through))

    def _form_replicas(self, now: float) -> None:
        """Form the replicas that are out again where the domain finds nodes for them; the world path
        takes over if the worker group cannot."""
        assert self.placement is not None and self.watch is not None
        formed = self.replicas.formation(self.topology, self.placement,
                                         cluster=self._shown_by_the_way if self.topology_source is not None else None)
        if formed is None:
            return
        self.topology, self.placement = formed.topology, formed.placement  # (before the slow call: views see them)
        failure = self.replicas.form(now, formed, self.watch)
        if failure is not None:
            self._recover(now, failure, contain=False)

    def _recover(self, now: float, failure: FailureEvent, *, contain: bool = True) -> None:
        assert self.config is not None
        if contain and self._contain(now, failure):
            return
        self._detected(now, failure)
        self._shutdown()
        self._boundary.drop()  # (a stop asked of the attempt that failed: asked again if still wanted)
        self._replica_departure = None
        through = self.watch.take_rollback() if self.watch is not None else None
        if through is not None:
            # Whatever is decided next (even to fail), a later resume must not load suspect state;
            # a store that does not answer now gets the discard before the next launch reads it.
            with self.outside_lock():
                self._discarded(now, self.checkpoints.roll_back(through))
            self.checkpoints.exclude_peers(self.attempt, through)  # taken after the corruption, perhaps
        rejected = self.watch.take_rejected() if self.watch is not None else None
        if rejected is not None:  # never loaded again: the next attempt starts from the step before it
            with self.outside_lock():
                self._discarded(now, self.checkpoints.reject(*rejected))
        peer_rejected = self.watch.take_peer_rejected() if self.watch is not None else None
        if peer_rejected is not None:  # nor is a peer snapshot step that failed to load: an older one, or the store
            attempt, step, why = peer_rejected
            self.checkpoints.exclude_peers(attempt, step - 1)
            self.events.add(now, self.attempt, EventKind.CHECKPOINT_UNUSABLE, source="peer", step=step,
                            reason=f"the peer snapshot of step {step} (attempt {attempt}) failed to load: {why}")
        if self.topology_source is not None:  # lost nodes that are back (repaired) may take over
            self.topology = merge_returned(self.topology, self.topology_source())
        seen = raised(failure, step=self.progress.step + 1, node_of_rank=self.placement.node_of_rank) \
            if self.placement is not None else None
        judged = judge(self._raised, seen) if seen is not None else None
        if seen is not None and judged is Judgement.USER_ERROR:
            # The user's code, not the cluster: neither raising is charged to elastic.max_failures.
            self.failures = [f for f in self.failures if f is not self._raised_failure]
            self._fail(now, "user_error", f"user error: {seen.signature}, raised at step {seen.step} by rank(s) "
                                          f"{list(seen.ranks)} again after a restart on other nodes (it was raised on "
                                          f"{sorted(self._raised.nodes) if self._raised else []}, then on {sorted(seen.nodes)}): "
                                          "the model, data or provider code, not the cluster; fix it and "
                                          "`goodput resume` the run", traceback=seen.traceback)
            return
        decision = self.policy.on_failure(now, failure, failures_so_far=len(self.failures), mesh=self.config.mesh,
                                          topology=self.topology, waiting_since=self._waiting_since,
                                          placement=self.placement)
        if seen is not None and judged is Judgement.FIRST:
            self._raised, self._raised_failure = seen, failure
            decision = elsewhere(decision, seen, self.placement)
        self.failures.append(failure)
        self._apply(now, decision)

    def _detected(self, now: float, failure: FailureEvent, **detail: Any) -> None:
        """A failure joins the timeline; the last one is what a decision's quarantine is for."""
        self.events.add(now, self.attempt, EventKind.FAILURE_DETECTED, cause=failure.cause.value, nodes=list(failure.nodes),
                        ranks=list(failure.ranks), message=failure.message, step=self.progress.step, **detail)
        self._last_failure = failure

    def _apply(self, now: float, decision: Decision) -> None:
        mesh = decision.mesh
        self.stragglers = None  # its scores were of the attempt that just ended
        self.events.add(now, self.attempt, EventKind.DECISION, action=decision.action.value, code=decision.code,
                        reason=decision.reason, mesh=mesh.axes() if mesh else None,
                        dp_replicas=mesh.dp_replicas if mesh else None)
        for detail in taken_out(self.topology, decision, self._last_failure):
            self.events.add(now, self.attempt, EventKind.QUARANTINED, **detail)
            if detail["reason"] != "lost":
                self.quarantined.append({"node": detail["node"], "reason": detail["reason"],
                                         "evidence": detail["evidence"], "time": now})
        self.topology = decision.topology
        if decision.action is Action.FAIL:
            self._fail(now, decision.code, decision.reason)
            return
        if decision.action is Action.WAIT:
            self._waiting_since = self._waiting_since or now
            self.state = RunState.RECOVERING
            return
        assert mesh is not None
        self._waiting_since = None
        self.config = self.spec.trainer_config(mesh)
        self.placement = decision.placement if decision.placement is not None else place(mesh, self.topology)
        self.state = RunState.LAUNCHING

    def _on_recovering(self, now: float) -> None:
        """Waiting below min_dp: launch as soon as the healthy nodes hold dp >= min_dp again; fail
        once the wait is over."""
        if self.topology_source is not None:
            self.topology = merge_returned(self.topology, self.topology_source())
        assert self.config is not None
        decision = self.policy.on_capacity(now, mesh=self.config.mesh, topology=self.topology,
                                           waiting_since=self._waiting_since)
        if decision.action is not Action.WAIT:
            self._apply(now, decision)

    def _policy(self) -> RunPolicy:
        e, t = self.spec.elastic, self.spec.train
        return RunPolicy(limits=ElasticLimits(min_dp=e.min_dp, max_failures=e.max_failures,
                                              wait_for_capacity_s=e.wait_for_capacity_s),
                         global_batch=t.global_batch, micro_batch=t.micro_batch, spec_mesh=self.spec.fixed_mesh(),
                         fits=lambda mesh: memory_problem(self.spec, self.topology, mesh),
                         by_replica=e.failure_domain == "replica")

    def _maybe_grow(self, now: float) -> bool:
        """At a checkpoint boundary, grow back towards the spec's mesh if lost nodes returned."""
        if self.config is None or not self.policy.may_grow(self.config.mesh):
            return False
        if (shown := self._shown_by_the_way()) is None:
            return False
        merged = self._grow.changed(self.topology, shown)
        decision = None if merged is None else self.policy.on_commit(self.config.mesh, merged, step=self.progress.step)
        if decision is None:
            return False
        self._shutdown()
        self._apply(now, decision)
        return True

    def request_drill(self, now: float, kind: str, *, target: str | None = None, at_step: int | None = None,
                      **params: float | str | None) -> DrillRequest:
        """Queue a drill on this live run (`goodput drill`, the REST API); DrillError says what to fix."""
        if self.state.terminal:
            raise DrillError(f"run {self.run_id!r} has {self.state.value}; drills need a live run")
        replicas = self.placement.mesh.dp_replicas if self.placement is not None else 1
        if kind in set(DrillKind) and (problem := domain_problem(DrillKind(kind), self.spec.elastic.failure_domain,
                                                                   replicas)):
            raise DrillError(problem)
        request, detail = self.drills.request(now, kind, target=target, at_step=at_step, step=self.progress.step,
                                              placement=self.placement, **params)
        self.events.add(now, max(self.attempt, 0), EventKind.DRILL_REQUESTED, **detail)
        return request

    def drill_reports(self) -> list[dict[str, Any]]:
        return self.drills.reports(self.events.view())

    def drill(self, drill_id: str) -> dict[str, Any] | None:
        return self.drills.lookup(drill_id, self.events.view(), ended=self.state.terminal)

    def _run_due_drills(self, now: float) -> None:
        if self.injector is None or self.attempt_steps() == 0:
            return
        assert self.placement is not None
        for kind, detail in self.drills.inject_due(self.progress.step, self.placement, self.injector,
                                                   self.outside_lock):
            self.events.add(now, self.attempt, kind, **detail)

    def attempt_steps(self) -> int:
        return self.watch.steps if self.watch is not None else 0

    def _fail(self, now: float, code: str, message: str, traceback: str | None = None) -> None:
        self.error = RunError(code, message, traceback)
        self._finish(now, RunState.FAILED, code=code, message=message,
                     **({"traceback": traceback} if traceback is not None else {}))

    def _finish(self, now: float, state: RunState, **detail: Any) -> None:
        self.state = state
        self.finished_at = now
        self.events.add(now, max(self.attempt, 0), EventKind(state.value), **detail)

    # -- views (controller.views) ------------------------------------------------------------------
    def goodput(self, now: float, *, fresh: bool = False) -> dict[str, Any]:
        """ETTR and where the rest of the wall time went, up to now or the end."""
        return self._goodput.of(self, now, fresh=fresh)

    def health(self) -> dict[str, Any]:
        return health_view(self)

    def to_dict(self, now: float, *, full: bool = True) -> dict[str, Any]:
        return run_view(self, now, full=full)

