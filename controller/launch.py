"""Launching an attempt, the controller's side: where it starts (a committed step or a peer snapshot
step, controller/checkpoints.py), what its AttemptSpec says, the launch, and the `attempt_started`
record. Functions of the RunController they act for (controller/state.py); a restarted service builds
the AttemptSpec of the attempt it re-attaches to the same way (controller/service/restore.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointing.manifest import ForeignCheckpoints, IdentityMismatch
from checkpointing.store import StoreError
from controller.attempt import AttemptSpec
from controller.checkpoints import LoadPoint
from controller.events import EventKind
from controller.placement import Placement
from controller.run_state import RunState
from trainer.config import TrainerConfig

if TYPE_CHECKING:
    from controller.state import RunController


def attempt_spec(c: "RunController", now: float, config: TrainerConfig, placement: Placement,
                 point: LoadPoint) -> AttemptSpec:
    """The AttemptSpec of attempt `c.attempt` on `placement`, starting where `point` says."""
    domain = c.spec.elastic.failure_domain if placement.mesh.dp_replicas > 1 else "world"
    return AttemptSpec(
        run_id=c.run_id, attempt=c.attempt, config=config, placement=placement,
        start_step=point.start_step, cursor=point.cursor, resume_step=point.resume_step,
        **c.checkpoints.attempt_settings(c.spec, run_s=now - c.created_at, failures=len(c.failures)),
        **c.checkpoints.peer_settings(c.spec, placement, point, replicas=domain == "replica"),
        failure_domain=domain, batch_while_healing=c.spec.elastic.batch_while_healing,
        stoppable=c.stoppable and domain == "world" and (
            c.checkpoints.store is not None or c.spec.checkpoint.peer_every_steps > 0))


def launch(c: "RunController", now: float) -> None:
    """Start the next attempt where its checkpoints say (once the store answers), or end the run."""
    assert c.config is not None and c.placement is not None
    if not c.checkpoints.outage.due(now):
        return
    domain = c.spec.elastic.failure_domain if c.config.mesh.dp_replicas > 1 else "world"
    try:
        with c.outside_lock():
            nodes = c.placement.nodes()
            point = c.checkpoints.load_point(c.spec, c._peer_copies(nodes), nodes,
                                             replica_nodes=c.placement.replica_nodes() if domain == "replica" else None)
            c.checkpoints.raise_fence(c.attempt + 1, point.start_step)  # (before any of its ranks can commit)
    except StoreError as e:  # back off; past `checkpoint.retry_budget_s`, say so in the timeline (once)
        if (detail := c.checkpoints.unreachable(now, e)) is not None:
            c.events.add(now, max(c.attempt, 0), EventKind.STORE_UNAVAILABLE, **detail)
        return
    except (IdentityMismatch, ForeignCheckpoints) as e:
        c._fail(now, "checkpoint_mismatch" if isinstance(e, IdentityMismatch) else "checkpoints_in_the_way", str(e))
        return
    c._discarded(now, point.discarded)
    if (down := c.checkpoints.outage.answered(now)) is not None:
        c.events.add(now, max(c.attempt, 0), EventKind.STORE_AVAILABLE, down_s=down)
    if c._cancel_requested:
        return  # the next step cancels
    c.attempt += 1
    for reason in point.unusable:
        c.events.add(now, c.attempt, EventKind.CHECKPOINT_UNUSABLE, reason=reason)
    start_step = point.start_step
    unheard = c.progress.add_unheard(point.peer.reports) if point.peer is not None else []
    attempt = attempt_spec(c, now, c.config, c.placement, point)
    c._track_attempt(now)
    try:
        with c.outside_lock():
            c.worker_group.start(attempt)
    except Exception as e:  # noqa: BLE001 - any launch failure ends the attempt with its reason
        c._shutdown()
        if c._cancel_requested:
            return  # the launch gave up because of the cancel: the next step cancels
        c._launch_failed(now, f"{type(e).__name__}: {e}")
        return
    mesh = c.config.mesh
    c.events.add(now, c.attempt, EventKind.ATTEMPT_STARTED,
                 mesh=mesh.axes(), dp_replicas=mesh.dp_replicas,
                 placement=c.placement.columns(), spares=list(c.placement.spares),
                 start_step=start_step, resume_step=point.resume_step, cursor=point.cursor,
                 restore_from=point.source, **({"reports_from_snapshot": unheard} if unheard else {}),
                 **({"peer_replicas": list(point.peer_replicas)} if point.peer_replicas is not None else {}),
                 **({"peer_unusable": point.peer_unusable} if point.peer_unusable and c.attempt > 0 else {}))
    c.progress.committed = start_step
    if start_step >= c.spec.train.steps:
        c._shutdown()
        c._finish(now, RunState.SUCCEEDED, step=start_step)
        return
    c.state = RunState.RUNNING


WARM_SPARES_EVERY_S = 5.0
"""How often a running attempt looks for spares without warm workers (`warm_spares`)."""


def warm_spares(c: "RunController", now: float) -> None:
    """Spares the cluster gives this run that its worker group has no warm workers on (a node back
    from repair refills the spare pool after the launch, and a group's first launch leaves its spares
    to this) get them now, not on the next recovery's path (controller/ray/worker_group.py,
    `prewarm`). Only once the attempt has finished a step: on 2 cores their start would otherwise
    slow the attempt's own first step."""
    prewarm = getattr(c.worker_group, "prewarm", None)
    if prewarm is None or c.topology_source is None or now - c.warmed_at < WARM_SPARES_EVERY_S:
        return
    if not c.progress.has_stepped(c.attempt):
        return
    c.warmed_at = now
    with c.outside_lock():
        prewarm([n.name for n in c.topology_source().spares()])
