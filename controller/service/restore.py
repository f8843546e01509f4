"""A restarted service carries on the runs its registry shows. Each run's controller is built again
from its spec and timeline; then, by what the registry says of it:
- ended: it stays as it ended;
- running, with every rank of its attempt still training (workers outlive the service on a cluster it
  joined): the new controller re-attaches to them and drives that attempt on;
- otherwise, if it had launched: its workers went with the old service, so it goes back through the
  queue and starts a new attempt from its latest verified checkpoint (`service_restarted` says so);
- pending and never launched: it waits in the queue as before.
Nothing committed is lost: checkpoints are in the object store, the timeline in the database."""

from __future__ import annotations

import enum
import sys
from typing import Any

from controller.attempt import WorkerGroup
from controller.checkpoints import LoadPoint
from controller.events import EventKind
from controller.placement import Placement
from controller.run_state import RunError, RunState
from controller.state import RunController
from trainer.config import MeshShape


class Carried(enum.Enum):
    ENDED = "ended"
    REATTACHED = "reattached"
    RESTARTS = "restarts"
    """Goes back through the queue for a new attempt from its checkpoint."""
    QUEUED = "queued"
    FAILED = "failed"
    """It had launched, and its checkpoint store cannot be reached to resume it."""


def carry_on(c: RunController, row: dict[str, Any], events: list[dict[str, Any]], *, store_reachable: bool,
             now: float) -> Carried:
    """Bring a rebuilt controller (timeline restored) to where its run stands, by its registry row."""
    state = RunState(row["state"])
    if state.terminal:
        error = RunError(row["error"]["code"], row["error"]["message"], row["error"].get("traceback")) \
            if row["error"] else None
        c.ended_as(state, row["finished_at"], error)
        return Carried.ENDED
    if state is RunState.RUNNING and reattach(c, events, now):
        return Carried.REATTACHED
    if state is RunState.PENDING and c.attempt < 0:
        return Carried.QUEUED
    close = getattr(c.worker_group, "close", None)
    if close is not None:
        close()  # what is left of the old workers must not hold GPU slots
    c.record(now, EventKind.SERVICE_RESTARTED, previous_state=state.value,
             action="resume from the latest verified checkpoint as a new attempt")
    if not store_reachable:
        c.fail(now, "store_unavailable", f"checkpoint.uri {c.spec.checkpoint.uri!r} cannot be reached")
        return Carried.FAILED
    return Carried.RESTARTS


def reattach(c: RunController, events: list[dict[str, Any]], now: float) -> bool:
    """A run that was training when the previous service died: take over its attempt if every rank of
    it still trains."""
    group: WorkerGroup = c.worker_group
    attach = getattr(group, "attach", None)
    started = [e for e in events if e["kind"] == EventKind.ATTEMPT_STARTED]
    if attach is None or not started or started[-1]["attempt"] != c.attempt:
        return False
    d = started[-1]["detail"]
    since = events[events.index(started[-1]):]
    # a replica formed again on other nodes since: its placement is the one its rejoin recorded
    moved = [e for e in since if e["kind"] == EventKind.REPLICA_REJOINED and e["detail"].get("placement")]
    out = replicas_out(since)
    rejoined = {int(k) for e in since if e["kind"] == EventKind.REPLICA_REJOINED for k in e["detail"].get("replicas", ())}
    try:
        recorded = d.get("mesh") or {}
        mesh = MeshShape(dp=recorded.get("dp", 1), pp=recorded.get("pp", 1), tp=recorded.get("tp", 1),
                         dp_replicas=d.get("dp_replicas", 1))
        placement = Placement.recorded((moved[-1]["detail"] if moved else d)["placement"], mesh, d.get("spares") or [])
        point = LoadPoint(start_step=int(d.get("start_step") or 0), cursor=int(d.get("cursor") or 0),
                          resume_step=d.get("resume_step"), unusable=[], discarded=[])
        attempt = c.attempt_spec(now, c.spec.trainer_config(placement.mesh), placement, point)
        per = mesh.world_size // mesh.dp_replicas
        out = {k: tuple(n for n in nodes if n in placement.node_of_rank[k * per:(k + 1) * per]) for k, nodes in out.items()}
        if not (attach(attempt, frozenset(out), frozenset(rejoined - set(out))) if out or rejoined else attach(attempt)):
            return False
    except Exception as e:  # noqa: BLE001 - not attachable: the caller resumes from a checkpoint
        print(f"goodput: run {c.run_id}: cannot re-attach ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return False
    c.adopt(now, attempt, replicas_out=out)
    c.confine(set(placement.nodes_used()) | set(placement.spares))
    c.record(now, EventKind.SERVICE_RESTARTED, previous_state="running",
             action=f"re-attached to the live workers of attempt {c.attempt}"
                    + (f"; replica(s) {sorted(out)}, lost and not rejoined, are formed again" if out else ""))
    return True


def replicas_out(events: list[dict[str, Any]]) -> dict[int, tuple[str, ...]]:
    """failure_domain replica: the replicas an attempt's timeline (`events`, from its start) shows lost
    and not rejoined since (a service that ended in the middle of a heal), with the nodes they lost."""
    out: dict[int, tuple[str, ...]] = {}
    for e in events:
        if e["kind"] == EventKind.REPLICA_LOST:
            for k in e["detail"].get("replicas", ()):
                out[int(k)] = tuple(e["detail"].get("nodes") or ())
        elif e["kind"] == EventKind.REPLICA_REJOINED:
            for k in e["detail"].get("replicas", ()):
                out.pop(int(k), None)
    return out
