"""The run controller: an explicit state machine advanced one step per `step(now)` call.

pending -> planning -> launching -> running -> succeeded | failed | cancelled
A failure while running is attributed (controller.attribution), handed to the failure policy, and
the decision acted on: back to launching with a new mesh/placement (a new attempt), or recovering
while it waits for capacity, or failed.

Plain Python: the worker group is injected (Ray in production, a fake in tests) and time is passed
in. The controller decides; the worker group only does what it is told.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from checkpointing.manifest import Discards, ForeignCheckpoints, IdentityMismatch, resume_point
from checkpointing.schedule import observed_mtbf_s
from checkpointing.store import ObjectStore, StoreError, StoreOutage
from controller.attempt import AttemptSpec, GroupStatus, PollResult, WorkerGroup
from controller.events import EventKind, EventLog
from controller.placement import Placement, place
from controller.planner import MeshPlan, memory_problem, plan_run
from controller.progress import RunProgress
from controller.spec import RunSpec, SpecError
from controller.attribution import (
    AttemptSignals, failures_from, final_save_failure, quarantines_from, sdc_failure, straggler_events,
    straggler_replacement,
)
from controller.drills import DrillError, DrillInjector, DrillRequest, RunDrills
from controller.failure_policy import (
    Action, Decision, ElasticLimits, FailureCause, FailureEvent, capacity_decision, decide, grow_decision,
    grow_target,
)
from controller.topology import NodeState, Topology, merge_returned
from controller.views import GoodputView, health_view, run_view
from health.straggler import StragglerConfig, StragglerTracker
from trainer.config import MeshShape, TrainerConfig, state_fingerprint, state_identity


class RunState(str, enum.Enum):
    PENDING = "pending"
    PLANNING = "planning"
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


@dataclass
class RunError:
    code: str
    message: str


class RunController:
    def __init__(self, spec: RunSpec, topology: Topology, worker_group: WorkerGroup, *, now: float,
                 checkpoint_store: ObjectStore | None = None, run_id: str | None = None,
                 injector: DrillInjector | None = None,
                 topology_source: Callable[[], Topology] | None = None,
                 own_checkpoints_only: bool = False) -> None:
        self.spec = spec
        self.run_id = run_id or spec.name
        self._topology = topology.with_racks(spec.cluster.racks)
        self.worker_group = worker_group
        self.checkpoint_store = checkpoint_store
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
        self._auto_interval = 0
        """`auto`: the interval the last attempt chose, for the next one to start with (it measures the
        save cost again at its first save); 0 before any was chosen."""
        self._grow_checked: frozenset[str] | None = None
        self._grow_inputs: tuple[Topology, Topology] | None = None
        """The usable nodes the last grow check saw (the same nodes cannot hold a bigger mesh now)."""
        self._goodput = GoodputView()
        self.topology_source = topology_source
        self.drills = RunDrills(self.run_id, spec.drills)
        self.failures: list[FailureEvent] = []
        self.quarantined: list[dict[str, Any]] = []
        """Nodes taken out of the run for good: {node, reason, evidence, time}."""
        self.stragglers: StragglerTracker | None = None
        self._replace_stragglers: set[int] = set()
        self._rollback_through: int | None = None
        """SDC: the last step the probes vouch for; newer commits are discarded once the attempt is down."""
        self._waiting_since: float | None = None
        self._last_failure: FailureEvent | None = None
        self.discards = Discards(self.run_id)
        """Discards owed before the next launch reads: a resume's step (newer commits go), an SDC rollback."""
        self.own_checkpoints_only = own_checkpoints_only
        """A submitted run (goodput serve) is a new run: it never loads a checkpoint committed before it
        was submitted (another run's, under the same id) unless resumed on purpose (`adopted`)."""
        self.adopted = False
        """Resumed on purpose (goodput resume): the checkpoints under its id are its to load, whoever wrote them."""
        self.store_outage = StoreOutage(spec.checkpoint.retry_budget_s)
        self.waiting_for: str | None = None
        """Why a submitted run has not started (set by the service that queues it)."""
        self.outside_lock: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        """Entered around every slow call: store I/O, launch, shutdown, drill injection. A service that
        drives this controller under a lock releases it here, so its requests never wait behind I/O
        (only the driving thread changes the run's state; requests only set flags and queue drills)."""
        self._reset_attempt_tracking()
        self.events.add(now, 0, EventKind.SUBMITTED, name=spec.name)
        self._handlers: dict[RunState, Callable[[float], None]] = {
            RunState.PENDING: self._on_pending,
            RunState.PLANNING: self._on_planning,
            RunState.LAUNCHING: self._on_launching,
            RunState.RUNNING: self._on_running,
            RunState.RECOVERING: self._on_recovering,
        }

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
        self._handlers[self.state](now)
        return self.state

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

    def record(self, now: float, kind: EventKind, **detail: Any) -> None:
        """An event from outside the machine (the service's restarts, a node's cordon) in the timeline."""
        self.events.add(now, max(self.attempt, 0), kind, **detail)

    def admit(self, free: Topology) -> None:
        """A service admits the run onto these free nodes: it plans on them (then `confine`s itself)."""
        self.topology = free
        self.waiting_for = None

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
        intervals = [e["detail"].get("steps", 0) for e in events if e["kind"] == EventKind.CHECKPOINT_INTERVAL]
        self._auto_interval = int(intervals[-1]) if intervals else 0
        self.attempt = max((e["attempt"] for e in events if e["kind"] == EventKind.ATTEMPT_STARTED), default=-1)
        self.adopted = any(e["kind"] == EventKind.RESUME_REQUESTED for e in events)
        self.quarantined = quarantines_from(events)
        self.failures = failures_from(events)
        self.drills.restore(events)

    def attempt_spec(self, attempt: int, placement: Placement, *, start_step: int, cursor: int,
                     resume_step: int | None) -> AttemptSpec:
        """The AttemptSpec an attempt was launched with (for re-attaching to its live workers)."""
        config = self.spec.trainer_config(placement.mesh)
        return AttemptSpec(run_id=self.run_id, attempt=attempt, config=config, placement=placement,
                           start_step=start_step, cursor=cursor, resume_step=resume_step)

    def adopt(self, now: float, attempt: AttemptSpec) -> None:
        """Go on driving an attempt whose workers run on (a restarted service re-attached to them)."""
        self.attempt = attempt.attempt
        self.placement = attempt.placement
        self.config = attempt.config
        self.progress.committed = attempt.start_step
        self._track_attempt(now)
        self.state = RunState.RUNNING

    def _track_attempt(self, now: float) -> None:
        """Fresh per-attempt bookkeeping: failure signals, progress timestamps, straggler scores."""
        assert self.config is not None
        self._attempt_started_at = now
        self._reset_attempt_tracking()
        mesh = self.config.mesh
        self.stragglers = StragglerTracker(
            {r: mesh.stage_of(r) for r in range(mesh.world_size)},
            StragglerConfig(ratio=self.spec.health.straggler_ratio))
        self._replace_stragglers = set()

    def resume(self, now: float, *, step: int | None, steps: int | None, spec: RunSpec, worker_group: WorkerGroup,
               injector: DrillInjector | None) -> None:
        """Start an ended run again (a new attempt, on a fresh worker group) from its latest or the given
        committed step."""
        assert self.state.terminal
        self.spec = spec
        self.worker_group, self.injector = worker_group, injector
        self.discards.resume_to(step)
        self._cancel_requested = False
        self.error = None
        self.finished_at = None
        self.state = RunState.PENDING
        self.adopted = True
        self.events.add(now, max(self.attempt, 0), EventKind.RESUME_REQUESTED, step=step, steps=spec.train.steps)

    def _on_pending(self, now: float) -> None:
        self.state = RunState.PLANNING

    def _on_planning(self, now: float) -> None:
        try:
            self.plan, self.placement = plan_run(self.spec, self.topology)
        except SpecError as e:
            self._fail(now, "plan_infeasible", str(e))
            return
        self.config = self.spec.trainer_config(self.plan.mesh)
        mesh = self.plan.mesh
        self.events.add(now, 0, EventKind.PLANNED, mesh=mesh.axes(),
                        memory_per_gpu_bytes=self.plan.memory_per_gpu_bytes, explanation=self.plan.explanation)
        self.state = RunState.LAUNCHING

    def _on_launching(self, now: float) -> None:
        assert self.config is not None and self.placement is not None
        if not self.store_outage.due(now):
            return
        try:
            with self.outside_lock():
                start_step, cursor, resume_step, unusable, discarded = self._checkpoint_to_load()
        except StoreError as e:
            self._store_unreachable(now, e)
            return
        except IdentityMismatch as e:
            self._fail(now, "checkpoint_mismatch", str(e))
            return
        except ForeignCheckpoints as e:
            self._fail(now, "checkpoints_in_the_way", str(e))
            return
        for step, reason in discarded:
            self.events.add(now, self.attempt, EventKind.CHECKPOINT_DISCARDED, step=step, reason=reason)
        self._store_reachable(now)
        if self._cancel_requested:
            return  # the next step cancels
        self.attempt += 1
        for reason in unusable:
            self.events.add(now, self.attempt, EventKind.CHECKPOINT_UNUSABLE, reason=reason)
        every = self.spec.checkpoint.every_steps
        mtbf_h = self.spec.checkpoint.mtbf_hours
        attempt = AttemptSpec(
            run_id=self.run_id, attempt=self.attempt, config=self.config, placement=self.placement,
            start_step=start_step, cursor=cursor, resume_step=resume_step,
            checkpoint_uri=self.checkpoint_store.uri if self.checkpoint_store else None,
            checkpoint_every=every if isinstance(every, int) else self._auto_interval,
            checkpoint_auto=every == "auto",
            checkpoint_keep=self.spec.checkpoint.keep, store_retry_budget_s=self.spec.checkpoint.retry_budget_s,
            mtbf_s=observed_mtbf_s(now - self.created_at, len(self.failures), mtbf_h * 3600 if mtbf_h else None),
        )
        self._track_attempt(now)
        try:
            with self.outside_lock():
                self.worker_group.start(attempt)
        except Exception as e:  # noqa: BLE001 - any launch failure ends the attempt with its reason
            self._shutdown()
            if self._cancel_requested:
                return  # the launch gave up because of the cancel: the next step cancels
            self._launch_failed(now, f"{type(e).__name__}: {e}")
            return
        mesh = self.config.mesh
        self.events.add(now, self.attempt, EventKind.ATTEMPT_STARTED,
                        mesh=mesh.axes(), dp_replicas=mesh.dp_replicas,
                        placement=list(self.placement.rows()), spares=list(self.placement.spares),
                        start_step=start_step, resume_step=resume_step, cursor=cursor)
        self.progress.committed = start_step
        if start_step >= self.spec.train.steps:
            self._shutdown()
            self._finish(now, RunState.SUCCEEDED, step=start_step)
            return
        self.state = RunState.RUNNING

    def _checkpoint_to_load(self) -> tuple[int, int, int | None, list[str], list[tuple[int, str]]]:
        """(start step, cursor, step to load, why newer steps are unusable, steps discarded and why) for
        the next attempt, after the discards still owed (a resume to an older step, an SDC rollback).
        Store I/O only, outside the lock; StoreError when the store cannot be reached: nothing is
        decided from an outage."""
        if self.checkpoint_store is None:
            return 0, 0, None, [], []
        self.discards.settle(self.checkpoint_store)
        model = self.spec.to_model_config()
        found = resume_point(self.checkpoint_store, self.run_id, identity=state_fingerprint(model),
                             identity_detail=state_identity(model),
                             not_before=self.created_at if self.own_checkpoints_only and not self.adopted else None)
        discarded = self.discards.take_done()  # kept across tries: an outage after a discard loses no event
        if found is None:
            return 0, 0, None, [], discarded
        manifest, skipped = found
        return manifest.step, manifest.cursor, manifest.step, skipped, discarded

    def _store_unreachable(self, now: float, error: StoreError) -> None:
        """The checkpoint store did not answer: try again after a backoff; once it has been down longer
        than `checkpoint.retry_budget_s`, say so in the timeline (once)."""
        outage = self.store_outage
        if outage.failed(now):
            self.events.add(now, max(self.attempt, 0), EventKind.STORE_UNAVAILABLE, error=str(error),
                            since=outage.since, retry_in_s=outage.backoff_s,
                            uri=self.checkpoint_store.uri if self.checkpoint_store else None)

    def _store_reachable(self, now: float) -> None:
        down = self.store_outage.answered(now)
        if down is not None:
            self.events.add(now, max(self.attempt, 0), EventKind.STORE_AVAILABLE, down_s=down)

    def _reset_attempt_tracking(self) -> None:
        self.signals = AttemptSignals()
        self._final_save_error: str | None = None
        """Why the last step's save of this attempt failed (None: it committed, or has not failed)."""

    def _launch_failed(self, now: float, message: str) -> None:
        """A first launch that fails ends the run; a relaunch during recovery is one more failure
        (a node may have died without Ray saying so yet: nodes missing from the cluster are lost)."""
        if self.attempt == 0 or self.topology_source is None:
            self._fail(now, "launch_failed", message)
            return
        assert self.placement is not None
        live = {n.name for n in self.topology_source().nodes}
        missing = tuple(sorted(set(self.placement.node_of_rank) - live))
        cause = FailureCause.NODE_LOST if missing else FailureCause.WORKER_ERROR
        self._recover(now, FailureEvent(time=now, cause=cause, nodes=missing, message=f"relaunch failed: {message}"))

    def _on_running(self, now: float) -> None:
        with self.outside_lock():
            result = self.worker_group.poll()
        for report in result.reports:
            first = not self.progress.history or self.progress.history[-1]["attempt"] != self.attempt
            self.signals.heard(report.rank, report.step, now)
            if self.stragglers is not None:
                self.stragglers.add(report.rank, report.step, report.compute_s)
            if self.progress.add(report, heard_at=now):
                self.signals.stepped(report.step_time_s)
                if first:
                    if self.attempt > 0:
                        self.events.add(now, self.attempt, EventKind.FIRST_STEP_AFTER_RECOVERY, step=report.step)
        self._judge_stragglers(now)
        suspect = next((detail for _, kind, detail in result.events if kind == EventKind.SDC_SUSPECT), None)
        committed = False
        for rank, kind, detail in result.events:  # every event of the poll joins the timeline first
            self.events.add(now, self.attempt, kind, rank=rank, **detail)
            if kind == EventKind.CHECKPOINT_INTERVAL:
                self._auto_interval = int(detail.get("steps", 0))
            committed = committed or kind == EventKind.CHECKPOINT_COMMITTED
            if kind in (EventKind.CHECKPOINT_FAILED, EventKind.CHECKPOINT_COMMITTED) \
                    and detail.get("step") == self.spec.train.steps:
                self._final_save_error = detail.get("error", "failed") if kind == EventKind.CHECKPOINT_FAILED else None
        if suspect is None and committed and (self._maybe_replace_stragglers(now) or self._maybe_grow(now)):
            return
        if suspect is not None:  # the probes' evidence is the cause; the ranks' errors that follow are not
            assert self.placement is not None
            sdc, self._rollback_through = sdc_failure(now, suspect, self.placement.node_of_rank)
            self._recover(now, sdc)
            return
        failure = self._detect(now, result)
        if failure is not None:
            self._recover(now, failure)
        elif result.status is GroupStatus.FINISHED and self.signals.since is None:
            self._shutdown()
            if self._final_save_error is not None:
                self._recover(now, final_save_failure(now, self.spec.train.steps, self._final_save_error))
                return
            self._finish(now, RunState.SUCCEEDED, step=self.progress.step)
        else:
            self._run_due_drills(now)

    def _judge_stragglers(self, now: float) -> None:
        """Straggler verdicts become events; under `straggler_action: replace`, ranks slower than
        their peers are replaced at the next checkpoint (no step is lost) when a spare exists."""
        if self.stragglers is None or self.placement is None:
            return
        h = self.spec.health
        for detail in straggler_events(self.stragglers.evaluate(), self.placement.node_of_rank, ratio=h.straggler_ratio,
                                       action=h.straggler_action):
            self.events.add(now, self.attempt, EventKind.STRAGGLER, **detail)
            if h.straggler_action == "replace" and detail["basis"] == "relative":
                self._replace_stragglers.add(detail["rank"])

    def _maybe_replace_stragglers(self, now: float) -> bool:
        if not self._replace_stragglers or self.stragglers is None or self.placement is None:
            return False
        failure, self._replace_stragglers = straggler_replacement(
            now, self._replace_stragglers, self.stragglers.scores, self.placement.node_of_rank,
            spare=bool(self.topology.spares()), ratio=self.spec.health.straggler_ratio, step=self.progress.step)
        if failure is None:
            return False
        self._recover(now, failure)
        return True

    def _detect(self, now: float, result: PollResult) -> FailureEvent | None:
        assert self.placement is not None
        return self.signals.failure(now, result, self.placement.node_of_rank, hang_factor=self.spec.health.hang_factor,
                                    hang_floor_s=self.spec.health.hang_floor_s)

    def _recover(self, now: float, failure: FailureEvent) -> None:
        assert self.config is not None
        self.events.add(now, self.attempt, EventKind.FAILURE_DETECTED, cause=failure.cause.value, nodes=list(failure.nodes),
                        ranks=list(failure.ranks), message=failure.message, step=self.progress.step)
        self._last_failure = failure
        self._shutdown()
        if self._rollback_through is not None:
            # Whatever is decided next (even to fail), a later resume must not load suspect state;
            # a store that does not answer now gets the discard before the next launch reads it.
            with self.outside_lock():
                discarded = self.discards.roll_back(self.checkpoint_store, self._rollback_through)
            for step, reason in discarded:
                self.events.add(now, self.attempt, EventKind.CHECKPOINT_DISCARDED, step=step, reason=reason)
        self._rollback_through = None
        decision = decide(
            now, event=failure, failures_so_far=len(self.failures), mesh=self.config.mesh,
            spec_mesh=self.spec.fixed_mesh() or self.config.mesh, topology=self.topology, limits=self._limits(),
            global_batch=self.spec.train.global_batch, micro_batch=self.spec.train.micro_batch,
            waiting_since=self._waiting_since, fits=self._fits)
        self.failures.append(failure)
        self._apply(now, decision)

    def _apply(self, now: float, decision: Decision) -> None:
        mesh = decision.mesh
        self.stragglers = None  # its scores were of the attempt that just ended
        self.events.add(now, self.attempt, EventKind.DECISION, action=decision.action.value, code=decision.code,
                        reason=decision.reason, mesh=mesh.axes() if mesh else None,
                        dp_replicas=mesh.dp_replicas if mesh else None)
        failure = self._last_failure
        for node in self.topology.nodes:
            new_state = decision.topology.node(node.name).state
            if new_state is NodeState.LOST and node.state is not NodeState.LOST:
                self.events.add(now, self.attempt, EventKind.QUARANTINED, node=node.name, reason="lost")
            if new_state is NodeState.QUARANTINED and node.state is not NodeState.QUARANTINED:
                reason = failure.cause.value if failure else "quarantined"
                evidence = dict(failure.evidence) if failure else {}
                self.events.add(now, self.attempt, EventKind.QUARANTINED, node=node.name, reason=reason,
                                ranks=list(failure.ranks) if failure else [], message=failure.message if failure else "",
                                evidence=evidence)
                self.quarantined.append({"node": node.name, "reason": reason, "evidence": evidence, "time": now})
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
        decision = capacity_decision(
            now, mesh=self.config.mesh, topology=self.topology, limits=self._limits(),
            global_batch=self.spec.train.global_batch, micro_batch=self.spec.train.micro_batch,
            waiting_since=self._waiting_since, fits=self._fits, target=self.spec.fixed_mesh() or self.config.mesh,
            cause=f"after waiting {now - (self._waiting_since or now):.0f} s")
        if decision.action is not Action.WAIT:
            self._apply(now, decision)

    def _fits(self, mesh: MeshShape) -> str | None:
        return memory_problem(self.spec, self.topology, mesh)

    def _maybe_grow(self, now: float) -> bool:
        """At a checkpoint boundary, grow back towards the spec's mesh if lost nodes returned."""
        if self.topology_source is None or self.config is None:
            return False
        spec_mesh = self.spec.fixed_mesh() or self.config.mesh
        if self.config.mesh.dp >= spec_mesh.dp:
            return False
        live = self.topology_source()
        last = self._grow_inputs
        if last is not None and last[0] is self.topology and last[1] is live:  # the same objects: same answer
            return False
        self._grow_inputs = (self.topology, live)
        merged = merge_returned(self.topology, live)
        usable = merged.names_in(NodeState.HEALTHY) | merged.names_in(NodeState.SPARE)
        if usable == self._grow_checked:  # no node came back since the last check: nothing to grow into
            return False
        self._grow_checked = usable
        target = grow_target(self.config.mesh, spec_mesh, merged, self.spec.train.global_batch,
                             self.spec.train.micro_batch, self._fits)
        if target is None:
            return False
        self._shutdown()
        self._apply(now, grow_decision(self.config.mesh, target, merged, step=self.progress.step))
        return True

    def request_drill(self, now: float, kind: str, *, target: str | None = None, at_step: int | None = None,
                      factor: float | None = None, seconds: float | None = None) -> DrillRequest:
        """Queue a drill on this live run (`goodput drill`, the REST API); DrillError says what to fix."""
        if self.state.terminal:
            raise DrillError(f"run {self.run_id!r} has {self.state.value}; drills need a live run")
        request = self.drills.schedule.request(now, kind, target=target, at_step=at_step, step=self.progress.step,
                                      placement=self.placement, factor=factor, seconds=seconds)
        detail = request.to_dict()
        self.events.add(now, max(self.attempt, 0), EventKind.DRILL_REQUESTED, drill=detail.pop("kind"), **detail)
        return request

    def drill_reports(self) -> list[dict[str, Any]]:
        return self.drills.reports(self.events.view())

    def drill(self, drill_id: str) -> dict[str, Any] | None:
        return self.drills.lookup(drill_id, self.events.view(), ended=self.state.terminal)

    def _run_due_drills(self, now: float) -> None:
        if self.injector is None or self.attempt_steps() == 0:
            return
        assert self.placement is not None
        outcome = self.drills.inject_due(self.progress.step, self.placement, self.injector, self.outside_lock)
        if outcome is not None:
            self.events.add(now, self.attempt, outcome[0], **outcome[1])

    def attempt_steps(self) -> int:
        return self.signals.steps

    def _limits(self) -> ElasticLimits:
        e = self.spec.elastic
        return ElasticLimits(min_dp=e.min_dp, max_failures=e.max_failures, wait_for_capacity_s=e.wait_for_capacity_s)

    def _fail(self, now: float, code: str, message: str) -> None:
        self.error = RunError(code, message)
        self._finish(now, RunState.FAILED, code=code, message=message)

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

