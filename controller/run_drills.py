"""One run's drills: the schedule of those still to inject (the spec's and requested ones), the one
being injected, its injection, and the reports of those injected (controller/drill_reports.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager

from controller.drill_reports import DRILL_EVENTS, DrillReports
from controller.drills import (PARAMS, DrillError, DrillInjector, DrillKind, DrillRequest, DrillSchedule,
                               concrete_target, default_target, spec_drill_id, target_problem)
from controller.events import Event, EventKind
from controller.placement import Placement

if TYPE_CHECKING:
    from controller.spec import DrillSpec


class RunDrills:
    """One run's drills: those still to inject (the spec's and requested ones, in one schedule), the
    one being injected, and the reports of those injected, from the run's timeline."""

    def __init__(self, run_id: str, spec_drills: "list[DrillSpec]") -> None:
        self.schedule = DrillSchedule([
            DrillRequest(id=spec_drill_id(run_id, i), kind=d.kind, at_step=d.at_step, target=d.target,
                         **{name: getattr(d, name) for name in PARAMS})
            for i, d in enumerate(spec_drills)])
        self._reports = DrillReports()
        self._injecting: DrillRequest | None = None
        """The drill being injected (outside the lock): out of the schedule, not yet in the timeline."""

    def pending(self) -> list[DrillRequest]:
        return self.schedule.pending()

    def find(self, drill_id: str) -> DrillRequest | None:
        return self.schedule.find(drill_id)

    def request(self, now: float, kind: str, *, step: int, placement: Placement | None,
                **params: Any) -> tuple[DrillRequest, dict[str, Any]]:
        """Validate and queue a drill on a live run at `step` (DrillError says what to fix): the request
        and its `drill_requested` event detail."""
        request = self.schedule.request(now, kind, step=step, placement=placement, **params)
        detail = request.to_dict()
        return request, {"drill": detail.pop("kind"), **detail}

    def restore(self, events: list[dict[str, Any]]) -> None:
        """After a restart: the drills requested and not injected yet are due again (the spec's too)."""
        done = {e["detail"].get("id") for e in events if e["kind"] in DRILL_EVENTS}
        requested = [DrillRequest(id=d["id"], kind=DrillKind(d["drill"]), at_step=d.get("at_step"),
                                  target=d.get("target"), requested_at=d.get("requested_at"),
                                  **{name: d.get(name) for name in PARAMS})
                     for e in events if e["kind"] == EventKind.DRILL_REQUESTED and (d := e["detail"]).get("id") not in done]
        self.schedule = DrillSchedule([r for r in self.schedule.pending() if r.id not in done] + requested)

    def reports(self, events: list[Event]) -> list[dict[str, Any]]:
        """Every injected (or refused) drill's report, kept up to date incrementally."""
        return self._reports.of(events)

    def lookup(self, drill_id: str, events: list[Event], *, ended: bool) -> dict[str, Any] | None:
        """A drill's report once injected; before that, the request with outcome `pending` (being
        injected) or `scheduled` (`not_injected` if the run ended first). None if no such drill."""
        report = next((r for r in self.reports(events) if r["id"] == drill_id), None)
        if report is not None:
            return report
        injecting = self._injecting
        if injecting is not None and injecting.id == drill_id:
            return {**injecting.to_dict(), "outcome": "pending"}
        request = self.schedule.find(drill_id)
        if request is None:
            return None
        return {**request.to_dict(), "outcome": "not_injected" if ended else "scheduled"}

    def inject_due(self, step: int, placement: Placement, injector: DrillInjector,
                   outside_lock: Callable[[], ContextManager[Any]]) -> list[tuple[EventKind, dict[str, Any]]]:
        """Inject every drill whose step has come, together (two drills at one step hit at once: a
        node and its buddy's node lost together): (drill_injected, what was hit) or (drill_failed,
        why) for each, for the timeline."""
        outcomes = []
        while (drill := self.schedule.pop_due(step, injector.arms_ahead)) is not None:
            at = drill.at_step
            from_step = at + 1 if drill.kind in injector.arms_ahead and at is not None and at >= step else None
            outcomes.append(self._inject(drill, step, placement, injector, outside_lock, from_step))
        return outcomes

    def _inject(self, drill: DrillRequest, step: int, placement: Placement, injector: DrillInjector,
                outside_lock: Callable[[], ContextManager[Any]],
                from_step: int | None) -> tuple[EventKind, dict[str, Any]]:
        """Inject one drill; with `from_step` (a kind the injector arms ahead, its step still to come), it
        is handed over now to act from that step (its event says so: a rank holds it till then)."""
        asked = drill.target or default_target(drill.kind, placement)
        problem = target_problem(drill.kind, asked, placement)
        target = concrete_target(drill.kind, asked, placement)
        timing = ({"step": drill.at_step, "from_step": from_step, "armed_at_step": step} if from_step is not None
                  else {"step": step})
        facts = {"id": drill.id, "drill": drill.kind, "target": target, **timing,
                 **({"asked": asked} if asked != target else {}),
                 **{k: v for k, v in drill.to_dict().items() if k in PARAMS}}
        try:
            if problem is not None:
                raise DrillError(problem)
            self._injecting = drill  # a request for its report while it is injected finds it
            with outside_lock():
                ahead_of: dict[str, Any] = {"from_step": from_step} if from_step is not None else {}
                detail = injector.inject(drill.kind, target, **drill.params(), **ahead_of)
        except Exception as e:  # noqa: BLE001 - a drill that cannot be injected is reported, not fatal
            return EventKind.DRILL_FAILED, {**facts, "error": str(e)}
        finally:
            self._injecting = None
        return EventKind.DRILL_INJECTED, {**facts, **detail}
