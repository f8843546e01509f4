"""The run's timeline: every transition and notable fact, time-stamped, with run and attempt ids."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class EventKind(enum.StrEnum):
    """The one list of event kinds. The ranks report the ones marked (rank) as plain strings (the
    trainer does not import the controller); the controller names them here when they join the timeline."""

    SUBMITTED = "submitted"
    RUN_ID_CHOSEN = "run_id_chosen"
    RESUME_REQUESTED = "resume_requested"
    PLANNED = "planned"
    ATTEMPT_STARTED = "attempt_started"
    RESTORED = "restored"  # (rank) the attempt loaded a checkpoint
    RESTORE_FAILED = "restore_failed"  # (rank) a loading rank found the checkpoint's bytes corrupt
    INITIALISED = "initialised"  # (rank) a fresh start took its weights from a Hugging Face folder (model.init.hf)
    FIRST_STEP_AFTER_RECOVERY = "first_step_after_recovery"
    CHECKPOINT_STAGED = "checkpoint_staged"  # (rank)
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # (rank)
    CHECKPOINT_FAILED = "checkpoint_failed"  # (rank)
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # (rank)
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # (rank) checkpoint.every_steps: auto chose an interval
    RETENTION_DEFERRED = "retention_deferred"  # (rank)
    PEER_SNAPSHOTS = "peer_snapshots"  # (rank) an attempt's first peer snapshot is on every rank and buddy
    PEER_SNAPSHOT_FAILED = "peer_snapshot_failed"  # (rank) a copy to a buddy failed (its copies stay incomplete)
    CHECKPOINT_UNUSABLE = "checkpoint_unusable"
    CHECKPOINT_DISCARDED = "checkpoint_discarded"
    STORE_UNAVAILABLE = "store_unavailable"
    STORE_AVAILABLE = "store_available"
    STRAGGLER = "straggler"
    LOSS_ANOMALY = "loss_anomaly"  # (rank)
    SDC_SUSPECT = "sdc_suspect"  # (rank)
    SDC_TRANSIENT = "sdc_transient"  # (rank)
    BITFLIP_INJECTED = "bitflip_injected"  # (rank)
    FAILURE_DETECTED = "failure_detected"
    REPLICA_LOST = "replica_lost"  # the failure stopped only these data-parallel replicas; the others go on
    REPLICA_REJOINED = "replica_rejoined"  # (rank) replicas formed again, their state from a live one, training
    REPLICA_READY = "replica_ready"  # (rank) a replica formed again has built its world and waits to join
    REPLICA_STEP_DISCARDED = "replica_step_discarded"  # (rank) a cross-replica collective failed: nothing applied
    REPLICA_RESYNC = "replica_resync"  # a discarded step with no replica lost: an epoch of the same members evens them out
    SAMPLES_SKIPPED = "samples_skipped"  # (rank) batch_while_healing shrink: the out replicas' samples of these steps
    REPLICA_CHECKSUMS = "replica_checksums"  # (rank) every live replica's state checksum at one shard position
    # (rank) the ranks stopped after a step as asked (trainer/stop.py), its state kept (agreed_step: the step
    # after which they agreed to stop; they stop there, or at their next peer snapshot step)
    STOPPED_AT_BOUNDARY = "stopped_at_boundary"
    STOP_REQUESTED = "stop_requested"  # the controller asked the ranks to stop at their next step boundary (step: the last it had heard of)
    PREEMPTED = "preempted"  # the run stopped for a higher-priority run, its state kept: back to the queue
    TERMINATING = "terminating"  # (rank) its process got a SIGTERM (its node goes): the ranks leave at their next snapshot step
    DRAINED = "drained"  # the run stopped at a step boundary for nodes that must go, its state kept: reseated without them
    DECISION = "decision"
    CONTROLLER_ISOLATED = "controller_isolated"  # every node silent at once: the controller suspects itself
    CONTROLLER_ERROR = "controller_error"  # an exception inside the controller (a bug), with its traceback
    QUARANTINED = "quarantined"
    NODE_CORDONED = "node_cordoned"
    NODE_CORDON_FAILED = "node_cordon_failed"
    DRILL_REQUESTED = "drill_requested"
    DRILL_INJECTED = "drill_injected"
    DRILL_FAILED = "drill_failed"
    SERVICE_RESTARTED = "service_restarted"
    SERVICE_STOPPED = "service_stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @classmethod
    def ending(cls) -> tuple["EventKind", ...]:
        """The kinds that end a run."""
        return (cls.SUCCEEDED, cls.FAILED, cls.CANCELLED)


@dataclass(frozen=True)
class Event:
    time: float
    """Unix seconds."""
    run_id: str
    """Run the event belongs to."""
    attempt: int
    """Attempt number (0 for run-level events before the first launch)."""
    kind: EventKind
    """What happened (EventKind)."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Kind-specific facts."""

    def to_dict(self) -> dict[str, Any]:
        """The REST form. The detail is shared, not copied (an attempt's placement lists every rank):
        events are facts, never edited."""
        return {"time": self.time, "run_id": self.run_id, "attempt": self.attempt, "kind": self.kind,
                "detail": self.detail}


class EventLog:
    """Append-only and time-ordered: a later append with an earlier clock reading is clamped."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._events: list[Event] = []
        self._counts: dict[EventKind, int] = {}

    def add(self, now: float, attempt: int, kind: EventKind | str, **detail: Any) -> Event:
        """Append one event; a kind given as a string (a rank's report) must be an EventKind."""
        if self._events and now < self._events[-1].time:
            now = self._events[-1].time
        event = Event(now, self.run_id, attempt, EventKind(kind), detail)
        self._events.append(event)
        self._counts[event.kind] = self._counts.get(event.kind, 0) + 1
        return event

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Put back a timeline read from the registry (before anything else is added)."""
        self._events = [Event(r["time"], self.run_id, r["attempt"], EventKind(r["kind"]), dict(r["detail"])) for r in rows]
        self._counts = {}
        for e in self._events:
            self._counts[e.kind] = self._counts.get(e.kind, 0) + 1

    def count(self, kind: EventKind) -> int:
        """How many events of a kind (O(1): kept as they are added)."""
        return self._counts.get(kind, 0)

    def view(self) -> list[Event]:
        """The timeline itself, not a copy: read it, never change it."""
        return self._events

    def since(self, n: int) -> list[Event]:
        """Events after the first n (what a saver has not written yet)."""
        return self._events[n:]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self._events]

    def of_kind(self, kind: EventKind | str) -> list[Event]:
        return [e for e in self._events if e.kind == kind]
