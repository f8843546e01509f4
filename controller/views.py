"""What a run looks like from outside: the Run object (REST, CLI, registry), its health view, and its
goodput accounting, read from a RunController without changing it."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from controller.accounting import account
from controller.events import EventKind

if TYPE_CHECKING:
    from controller.state import RunController

HEALTH_KINDS = (EventKind.STRAGGLER, EventKind.SDC_SUSPECT, EventKind.SDC_TRANSIENT, EventKind.LOSS_ANOMALY)
"""Health events counted in the health view."""
SAVE_KINDS = (EventKind.CHECKPOINT_STAGED, EventKind.CHECKPOINT_COMMITTED, EventKind.CHECKPOINT_FAILED)
"""A save whose commit a failure cut off stalled the run too."""


class GoodputView:
    """ETTR and where the rest of the wall time went (controller.accounting), up to now or the run's
    end. Views and scrapes in the same second share one computation; the timeline's dict form is
    built once per event, as events arrive."""

    REFRESH_S = 1.0
    """A live run's accounting is recomputed at most this often (it costs O(steps)); an ended run's once."""

    def __init__(self) -> None:
        self._cache: tuple[float, int, dict[str, Any]] | None = None
        self._event_dicts: list[dict[str, Any]] = []

    def of(self, c: RunController, now: float, *, fresh: bool = False) -> dict[str, Any]:
        end = c.finished_at or now
        cached = self._cache
        if (not fresh and cached is not None and cached[1] == len(c.events)
                and (cached[0] == end or (c.finished_at is None and 0 <= end - cached[0] < self.REFRESH_S))):
            return cached[2]
        if len(self._event_dicts) > len(c.events):  # a restored timeline
            self._event_dicts = []
        self._event_dicts.extend(e.to_dict() for e in c.events.since(len(self._event_dicts)))
        events = self._event_dicts
        saves = [e["detail"]["step"] for e in events if e["kind"] in SAVE_KINDS and "step" in e["detail"]]
        if (every := c.spec.checkpoint.peer_every_steps) > 0:  # a peer snapshot holds the loop after these too
            saves += range(every, c.progress.step + 1, every)
        result = account(events, c.progress.spans, end=end, save_steps=saves).to_dict()
        self._cache = (end, len(c.events), result)
        return result


def health_view(c: RunController) -> dict[str, Any]:
    """Per-rank straggler scores of the current attempt, and the health events so far."""
    scores = []
    if c.stragglers is not None and c.placement is not None:
        for rank, score in sorted(c.stragglers.scores.items()):
            scores.append({"rank": rank, "node": c.placement.node_of_rank[rank], "stage": score.stage,
                           "relative": round(score.relative, 4),
                           "individual": None if score.individual is None else round(score.individual, 4),
                           "straggler": score.straggler})
    counts = {kind: c.events.count(kind) for kind in HEALTH_KINDS}
    return {"straggler_ratio": c.spec.health.straggler_ratio, "scores": scores, "counts": counts}


def budgets_view(c: RunController) -> dict[str, Any]:
    """What each kind of stop has cost the run, against its budget: infrastructure failures (node lost,
    hang, collective error, SDC, straggler) against elastic.max_failures; a user error gets one retry
    on other nodes; preemptions and drains are planned and never charged."""
    by_kind = collections.Counter(e.kind for e in c.events if e.kind in (EventKind.PREEMPTED, EventKind.DRAINED))
    return {"infrastructure": {"used": len(c.failures), "max": c.spec.elastic.max_failures},
            "user_error": {"retried": c.user_error_retried, "max_retries": 1},
            "preemptions": by_kind[EventKind.PREEMPTED], "drains": by_kind[EventKind.DRAINED]}


def run_view(c: RunController, now: float, *, full: bool = True) -> dict[str, Any]:
    """The Run object; `full` adds the per-step history and the whole timeline."""
    mesh = c.config.mesh if c.config else None
    store = c.checkpoints.store
    out: dict[str, Any] = {
        "id": c.run_id, "name": c.spec.name, "state": c.state.value,
        "created_at": c.created_at, "finished_at": c.finished_at,
        "step": c.progress.step, "total_steps": c.spec.train.steps, "loss": c.progress.loss,
        "attempt": max(c.attempt, 0),
        "mesh": mesh.axes() if mesh else None,
        "placement": list(c.placement.rows()) if c.placement else [],
        "goodput": c.goodput(now),
        "checkpoint_uri": store.uri if store is not None else c.spec.checkpoint.uri,
        "error": ({"code": c.error.code, "message": c.error.message}
                  | ({"traceback": c.error.traceback} if c.error.traceback else {})) if c.error else None,
    }
    out["budgets"] = budgets_view(c)
    out["waiting_for"] = c.waiting_for if c.state.value == "pending" else None
    out["drills"] = c.drill_reports()
    out["quarantined"] = list(c.quarantined)
    out["health"] = health_view(c)
    if full:
        out["history"] = c.progress.history
        out["events"] = [e.to_dict() for e in c.events]
    return out
