"""Failure-injection drills: the injector protocol, the schedule of drills still to inject, and the
drill report. The report is a pure function of the run's events, so tests, the CLI and the API read
the same figures. A drill comes from the spec's `drills:` list or is requested on a running run
(`goodput drill RUN KIND`, `POST /v1/runs/{id}/drills`); both go through the same schedule."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from controller.events import Event
from controller.placement import Placement

INJECTABLE = ("kill-node", "kill-rank", "hang-rank")
"""Drill kinds this controller can inject today."""


class DrillInjector(Protocol):
    def inject(self, kind: str, target: str) -> dict[str, Any]:
        """Do it (kill-node: SIGKILL the node's raylet; kill-rank: SIGKILL a worker; hang-rank: SIGSTOP
        a worker) and say what was hit."""
        ...


class DrillError(ValueError):
    """A drill request that cannot be honoured; the message says what to change."""


@dataclass(frozen=True)
class DrillRequest:
    id: str
    """Unique drill id (`drill-` + 8 hex digits)."""
    kind: str
    """kill-node, kill-rank or hang-rank."""
    at_step: int | None
    """Inject once the run has finished this step; None: as soon as the current attempt trains."""
    target: str | None
    """Node name or rank number; None: the node or rank of the last rank at injection time."""
    requested_at: float | None = None
    """Unix seconds the request arrived (None for the spec's drills)."""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "target": self.target, "at_step": self.at_step,
                "requested_at": self.requested_at}


def new_drill_id() -> str:
    return f"drill-{uuid.uuid4().hex[:8]}"


def default_target(kind: str, placement: Placement) -> str:
    """The last rank (or its node): the rank least likely to be the one a user watches."""
    last = placement.mesh.world_size - 1
    return placement.node_of_rank[last] if kind == "kill-node" else str(last)


def target_problem(kind: str, target: str, placement: Placement) -> str | None:
    """Why `target` cannot be hit by `kind` on this placement, or None if it can."""
    if kind == "kill-node":
        nodes = placement.nodes_used()
        if target not in nodes:
            return f"node {target!r} runs no rank of the current attempt; target one of {nodes}"
        return None
    world = placement.mesh.world_size
    if not target.isdigit() or int(target) >= world:
        return f"target {target!r} is not a rank of the current attempt; give a rank from 0 to {world - 1}"
    return None


class DrillSchedule:
    """Drills waiting for their step, in step order (a drill with no step goes first)."""

    def __init__(self, requests: list[DrillRequest] | None = None) -> None:
        self._pending: list[DrillRequest] = []
        for request in requests or []:
            self._add(request)

    def _add(self, request: DrillRequest) -> None:
        self._pending.append(request)
        self._pending.sort(key=lambda r: -1 if r.at_step is None else r.at_step)

    def request(self, now: float, kind: str, *, target: str | None, at_step: int | None, step: int,
                placement: Placement | None) -> DrillRequest:
        """Validate and queue a drill on a live run at `step`; DrillError says what to fix."""
        if kind not in INJECTABLE:
            raise DrillError(f"drill kind {kind!r} cannot be injected; use one of {', '.join(INJECTABLE)}")
        if at_step is not None and at_step < step:
            raise DrillError(f"at_step {at_step} has passed: the run is at step {step}; give a later step "
                             "or leave it out to inject now")
        if target is not None and placement is not None and (problem := target_problem(kind, target, placement)):
            raise DrillError(problem)
        request = DrillRequest(id=new_drill_id(), kind=kind, at_step=at_step, target=target, requested_at=now)
        self._add(request)
        return request

    def pop_due(self, step: int) -> DrillRequest | None:
        """The next drill whose step has come, removed from the schedule."""
        if self._pending and (self._pending[0].at_step is None or self._pending[0].at_step <= step):
            return self._pending.pop(0)
        return None

    def find(self, drill_id: str) -> DrillRequest | None:
        return next((r for r in self._pending if r.id == drill_id), None)

    def pending(self) -> list[DrillRequest]:
        return list(self._pending)


def drill_reports(events: list[Event]) -> list[dict[str, Any]]:
    """One report per injected (or refused) drill: injected_at, detected_at, recovered_at (first step
    finished on the new attempt), steps_lost (work redone since the last commit), decision, outcome."""
    reports = []
    for i, ev in enumerate(events):
        if ev.kind == "drill_failed":
            reports.append({"id": ev.detail.get("id"), "kind": ev.detail["drill"], "target": ev.detail.get("target"),
                            "at_step": ev.detail.get("step"), "injected_at": None, "detected_at": None,
                            "cause": None, "attributed_to": None, "decision": None, "recovered_at": None,
                            "steps_lost": None, "outcome": "not_injected", "error": ev.detail.get("error")})
            continue
        if ev.kind != "drill_injected":
            continue
        later = events[i + 1:]
        detected = next((e for e in later if e.kind == "failure_detected"), None)
        decision = next((e for e in later if e.kind == "decision"), None)
        recovered = next((e for e in later if e.kind == "first_step_after_recovery"), None)
        restored = next((e for e in later if e.kind == "attempt_started"), None)
        ended = next((e for e in later if e.kind in ("failed", "cancelled", "succeeded")), None)
        resumed_from = restored.detail.get("start_step", 0) if restored else None
        report: dict[str, Any] = {
            "id": ev.detail.get("id"), "kind": ev.detail["drill"], "target": ev.detail.get("target"),
            "at_step": ev.detail.get("step"),
            "injected_at": ev.time,
            "detected_at": detected.time if detected else None,
            "cause": detected.detail.get("cause") if detected else None,
            "attributed_to": ({"nodes": detected.detail.get("nodes"), "ranks": detected.detail.get("ranks")}
                              if detected else None),
            "decision": decision.detail.get("action") if decision else None,
            "recovered_at": recovered.time if recovered else None,
            "steps_lost": (ev.detail["step"] - resumed_from) if resumed_from is not None else None,
            "outcome": _outcome(recovered is not None, detected is not None, ended.kind if ended else None),
        }
        if detected:
            report["detection_s"] = detected.time - ev.time
        if recovered:
            report["recovery_s"] = recovered.time - ev.time
        reports.append(report)
    return reports


def _outcome(recovered: bool, detected: bool, ended: str | None) -> str:
    if recovered:
        return "recovered"
    if ended in ("failed", "cancelled"):
        return "failed"
    if ended == "succeeded":  # the run ended before it noticed, or resumed at the last step
        return "recovered" if detected else "not_detected"
    return "pending"
