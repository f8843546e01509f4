"""The run controller: an explicit state machine advanced one step per `step(now)` call.

pending -> planning -> launching -> running -> succeeded | failed | cancelled
(`recovering` is entered on a worker failure once a failure policy exists; today a failure fails the
run with the per-rank errors grouped into one message.)

Plain Python: the worker group is injected (Ray in production, a fake in tests) and time is passed
in. The controller decides; the worker group only does what it is told.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from checkpointing.manifest import latest_verified
from checkpointing.store import ObjectStore
from controller.events import EventLog
from controller.placement import Placement, PlacementError, place
from controller.planner import MeshPlan, PlanError, plan_mesh
from controller.progress import RunProgress
from controller.spec import RunSpec, SpecError
from controller.topology import Topology
from trainer.config import TrainerConfig
from trainer.report import StepReport


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


@dataclass(frozen=True, kw_only=True)
class AttemptSpec:
    """Everything a worker group needs to launch one attempt."""

    run_id: str
    """Run id (also the checkpoint folder)."""
    attempt: int
    """Attempt number."""
    config: TrainerConfig
    """Trainer config on this attempt's mesh."""
    placement: Placement
    """Rank -> (node, gpu)."""
    start_step: int = 0
    """Step to continue from."""
    cursor: int = 0
    """Sample cursor at start_step."""
    resume_step: int | None = None
    """Committed checkpoint step to load, if any."""
    checkpoint_uri: str | None = None
    """Object store of the checkpoints."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none, unless auto)."""
    checkpoint_auto: bool = False
    """Young/Daly interval instead of a fixed one."""
    checkpoint_keep: int = 3
    """Committed steps kept."""
    mtbf_s: float | None = None
    """MTBF for the Young/Daly rule."""


class GroupStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class PollResult:
    status: GroupStatus
    """Whole-group state."""
    reports: list[StepReport] = field(default_factory=list)
    """Step reports since the last poll."""
    events: list[tuple[int, str, dict]] = field(default_factory=list)
    """(rank, kind, detail) since the last poll."""
    errors: dict[int, str] = field(default_factory=dict)
    """rank -> error, when status is FAILED."""


class WorkerGroup(Protocol):
    def start(self, attempt: AttemptSpec) -> None: ...
    def poll(self) -> PollResult: ...
    def shutdown(self) -> None: ...


@dataclass
class RunError:
    code: str
    message: str


def group_errors(errors: dict[int, str]) -> str:
    """One readable message from per-rank errors: identical messages are listed once with their ranks."""
    by_message: dict[str, list[int]] = {}
    for rank, message in sorted(errors.items()):
        by_message.setdefault(message.strip().splitlines()[-1] if message.strip() else "died", []).append(rank)
    return "; ".join(f"ranks {ranks}: {msg}" for msg, ranks in by_message.items())


class RunController:
    def __init__(self, spec: RunSpec, topology: Topology, worker_group: WorkerGroup, *, now: float,
                 checkpoint_store: ObjectStore | None = None, run_id: str | None = None) -> None:
        self.spec = spec
        self.run_id = run_id or spec.name
        self.topology = topology
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
        self.progress = RunProgress(total_steps=spec.train.steps)
        self.badput: dict[str, float] = {"startup": 0.0, "checkpoint": 0.0}
        self._attempt_started_at = now
        self._cancel_requested = False
        self.events.add(now, 0, "submitted", name=spec.name)
        self._handlers: dict[RunState, Callable[[float], None]] = {
            RunState.PENDING: self._on_pending,
            RunState.PLANNING: self._on_planning,
            RunState.LAUNCHING: self._on_launching,
            RunState.RUNNING: self._on_running,
        }

    # -- the machine -----------------------------------------------------------------------------
    def step(self, now: float) -> RunState:
        """Advance at most one transition (or absorb one poll while running)."""
        if self.state.terminal:
            return self.state
        if self._cancel_requested:
            self.worker_group.shutdown()
            self._finish(now, RunState.CANCELLED, "cancelled")
            return self.state
        self._handlers[self.state](now)
        return self.state

    def cancel(self) -> None:
        self._cancel_requested = True

    def _on_pending(self, now: float) -> None:
        self.state = RunState.PLANNING

    def _on_planning(self, now: float) -> None:
        try:
            fixed = self.spec.fixed_mesh()
            if fixed is not None:
                self.spec.trainer_config(fixed)  # shape errors first: they say more than memory ones
            self.plan = plan_mesh(self.spec.to_model_config(), self.spec.to_train_config(), self.topology,
                                  fixed=fixed)
            self.config = self.spec.trainer_config(self.plan.mesh)
            self.placement = place(self.plan.mesh, self.topology)
        except (PlanError, PlacementError, SpecError) as e:
            self._fail(now, "plan_infeasible", str(e))
            return
        mesh = self.plan.mesh
        self.events.add(now, 0, "planned", mesh={"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp},
                        memory_per_gpu_bytes=self.plan.memory_per_gpu_bytes, explanation=self.plan.explanation)
        self.state = RunState.LAUNCHING

    def _on_launching(self, now: float) -> None:
        assert self.config is not None and self.placement is not None
        self.attempt += 1
        start_step, cursor, resume_step = 0, 0, None
        if self.checkpoint_store is not None:
            found = latest_verified(self.checkpoint_store, self.run_id)
            if found is not None:
                manifest, skipped = found
                for reason in skipped:
                    self.events.add(now, self.attempt, "checkpoint_unusable", reason=reason)
                start_step, cursor, resume_step = manifest.step, manifest.cursor, manifest.step
        every = self.spec.checkpoint.every_steps
        mtbf_h = self.spec.checkpoint.mtbf_hours
        attempt = AttemptSpec(
            run_id=self.run_id, attempt=self.attempt, config=self.config, placement=self.placement,
            start_step=start_step, cursor=cursor, resume_step=resume_step,
            checkpoint_uri=self.checkpoint_store.uri if self.checkpoint_store else None,
            checkpoint_every=every if isinstance(every, int) else 0, checkpoint_auto=every == "auto",
            checkpoint_keep=self.spec.checkpoint.keep, mtbf_s=mtbf_h * 3600 if mtbf_h else None,
        )
        self._attempt_started_at = now
        try:
            self.worker_group.start(attempt)
        except Exception as e:  # noqa: BLE001 - any launch failure ends the attempt with its reason
            self.worker_group.shutdown()
            self._fail(now, "launch_failed", f"{type(e).__name__}: {e}")
            return
        mesh = self.config.mesh
        self.events.add(now, self.attempt, "attempt_started",
                        mesh={"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp},
                        placement=list(self.placement.rows()), start_step=start_step,
                        resume_step=resume_step)
        if start_step >= self.spec.train.steps:
            self.worker_group.shutdown()
            self._finish(now, RunState.SUCCEEDED, "succeeded")
            return
        self.state = RunState.RUNNING

    def _on_running(self, now: float) -> None:
        result = self.worker_group.poll()
        for report in result.reports:
            first = not self.progress.history or self.progress.history[-1]["attempt"] != self.attempt
            if self.progress.add(report) and first:
                self.badput["startup"] += max(0.0, now - self._attempt_started_at - report.step_time_s)
        for rank, kind, detail in result.events:
            if kind == "checkpoint_committed":
                self.badput["checkpoint"] += float(detail.get("seconds", 0.0))
            self.events.add(now, self.attempt, kind, rank=rank, **detail)
        if result.status is GroupStatus.FINISHED:
            self.worker_group.shutdown()
            self._finish(now, RunState.SUCCEEDED, "succeeded", step=self.progress.step)
        elif result.status is GroupStatus.FAILED:
            self.worker_group.shutdown()
            self._fail(now, "worker_failed", group_errors(result.errors))

    def _fail(self, now: float, code: str, message: str) -> None:
        self.error = RunError(code, message)
        self._finish(now, RunState.FAILED, "failed", code=code, message=message)

    def _finish(self, now: float, state: RunState, kind: str, **detail: Any) -> None:
        self.state = state
        self.finished_at = now
        self.events.add(now, max(self.attempt, 0), kind, **detail)

    # -- views -----------------------------------------------------------------------------------
    def goodput(self, now: float) -> dict[str, Any]:
        """ETTR = time spent in kept training steps / wall time; the rest, by category."""
        end = self.finished_at or now
        wall = max(end - self.created_at, 1e-9)
        productive = sum(self.progress.step_times)
        other = max(0.0, wall - productive - sum(self.badput.values()))
        return {"ettr": productive / wall, "badput_seconds": {**self.badput, "other": other}}

    def to_dict(self, now: float, *, full: bool = True) -> dict[str, Any]:
        mesh = self.config.mesh if self.config else None
        out: dict[str, Any] = {
            "id": self.run_id, "name": self.spec.name, "state": self.state.value,
            "created_at": self.created_at, "finished_at": self.finished_at,
            "step": self.progress.step, "loss": self.progress.loss, "attempt": max(self.attempt, 0),
            "mesh": {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp} if mesh else None,
            "placement": list(self.placement.rows()) if self.placement else [],
            "goodput": self.goodput(now),
            "error": {"code": self.error.code, "message": self.error.message} if self.error else None,
        }
        if full:
            out["history"] = self.progress.history
            out["events"] = [e.to_dict() for e in self.events]
        return out
