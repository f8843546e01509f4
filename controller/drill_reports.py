"""The drill report: a pure function of the run's events (from its `drill_injected` or `drill_failed`
on: when the fault was made, detected, decided and recovered from, and the steps it cost), so tests,
the CLI and the API read the same figures; `DrillReports` keeps a growing timeline's reports up to date."""

from __future__ import annotations

from typing import Any

from controller.drills import PARAMS, DrillKind
from controller.events import Event, EventKind


def drill_reports(events: list[Event]) -> list[dict[str, Any]]:
    """One report per injected (or refused) drill: injected_at, detected_at, recovered_at (first step
    finished on the new attempt's ranks, recovery_heard_at when the controller heard of it; for
    storage-outage, the first commit after the outage), steps_lost
    (work redone since the last commit), decision, outcome."""
    return [drill_report(events, i) for i, ev in enumerate(events) if ev.kind in DRILL_EVENTS]


DRILL_EVENTS = (EventKind.DRILL_INJECTED, EventKind.DRILL_FAILED)
FINAL_OUTCOMES = frozenset({"recovered", "failed", "cancelled", "not_injected", "not_detected", "not_recovered",
                            "ridden_out"})
"""Outcomes no later event changes (a report with one need not be computed again)."""


def drill_report(events: list[Event], i: int) -> dict[str, Any]:
    """The report of the drill whose `drill_injected` (or `drill_failed`) is events[i]."""
    ev = events[i]
    if ev.kind == EventKind.DRILL_FAILED:
        return {"id": ev.detail.get("id"), "kind": ev.detail["drill"], "target": ev.detail.get("target"),
                "at_step": ev.detail.get("step"), "injected_at": None, "detected_at": None,
                "cause": None, "attributed_to": None, "decision": None, "recovered_at": None,
                "steps_lost": None, "outcome": "not_injected", "error": ev.detail.get("error")}
    # A drill's report ends with the run's first end after it: a run resumed later is another story
    # (its first step is no recovery from this fault), and a report is final once the run has ended.
    end = next((j for j in range(i + 1, len(events)) if events[j].kind in ENDS), len(events) - 1)
    later = events[i + 1:end + 1]
    kind = ev.detail["drill"]
    if kind == DrillKind.SLOW_RANK:
        report = _slow_rank_report(ev, later)
    elif kind == DrillKind.COLLECTIVE_FAULT and not _failed_first(later):
        report = _collective_fault_report(ev, later)
    elif kind == DrillKind.STORAGE_OUTAGE:
        report = _outage_report(ev, later)
    elif kind == DrillKind.SPOT_RECLAIM and not _failed_before(later, EventKind.DRAINED):
        report = _departure_report(ev, later)
    else:
        report = _failure_report(ev, later)
    report = {"id": ev.detail.get("id"), "kind": kind, "target": ev.detail.get("target"),
              "at_step": ev.detail.get("step"), "injected_at": ev.time, **report}
    for name in PARAMS:
        if name in ev.detail:
            report[name] = ev.detail[name]
    # (a silent fault is made on the node a moment later; a fault armed ahead acts at its step)
    acts_at = ev.detail.get("acts_at", report.pop("acts_at", None))
    origin = float(acts_at) if acts_at is not None else ev.time
    if acts_at is not None:
        report["fault_at"] = origin
    if report.get("detected_at") is not None:
        report["detection_s"] = report["detected_at"] - origin
    if report.get("recovered_at") is not None:
        report["recovery_s"] = report["recovered_at"] - origin
    if kind in RIDDEN_OUT and report["outcome"] == "not_detected":
        report["outcome"] = "ridden_out"  # (the run ended with no failure declared: what these should give)
    return report


RIDDEN_OUT = (DrillKind.SLOW_LINK, DrillKind.LOSSY_LINK, DrillKind.PARTITION)
"""Kinds a run may ride out with no failure declared (a slow or lossy link, a short partition)."""


class DrillReports:
    """The drill reports of a growing timeline, kept up to date incrementally: new events are scanned
    once, and only reports whose outcome may still change are computed again."""

    def __init__(self) -> None:
        self._scanned = 0
        self._at: list[int] = []
        self._reports: list[dict[str, Any]] = []

    def of(self, events: list[Event]) -> list[dict[str, Any]]:
        if len(events) < self._scanned:  # a restored timeline
            self.__init__()  # type: ignore[misc]
        if len(events) == self._scanned:
            return list(self._reports)
        for i in range(self._scanned, len(events)):
            if events[i].kind in DRILL_EVENTS:
                self._at.append(i)
                self._reports.append({})
        self._scanned = len(events)
        for k, i in enumerate(self._at):
            if self._reports[k].get("outcome") not in FINAL_OUTCOMES:
                self._reports[k] = drill_report(events, i)
        return list(self._reports)


def _first(events: list[Event], kind: str, **match: Any) -> Event | None:
    return next((e for e in events if e.kind == kind and all(e.detail.get(k) == v for k, v in match.items())), None)


ENDS = (EventKind.FAILED, EventKind.CANCELLED, EventKind.SUCCEEDED)


def _ended(events: list[Event]) -> Event | None:
    return next((e for e in events if e.kind in ENDS), None)


def _aftermath(later: list[Event]) -> tuple[Event | None, Event | None, Event | None, Event | None, int | None]:
    """What followed a drill: the first decision, first step after recovery, next attempt and end, and
    the step that attempt started from."""
    restored = _first(later, EventKind.ATTEMPT_STARTED)
    return (_first(later, EventKind.DECISION), _first(later, EventKind.FIRST_STEP_AFTER_RECOVERY), restored,
            _ended(later), restored.detail.get("start_step", 0) if restored else None)


def _failure_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """kill-node, kill-rank, hang-rank, bitflip: detected as a failure, decided on, recovered."""
    detected = _first(later, EventKind.FAILURE_DETECTED)
    decision, recovered, restored, ended, resumed_from = _aftermath(later)
    if detected is not None and detected.detail.get("replicas") is not None:
        # Only those replicas stopped: the survivors went on from the last step (the one in flight was
        # discarded), and the lost replicas took their state from a live one when they rejoined.
        lost = set(detected.detail["replicas"])
        rejoined = next((e for e in later if e.kind == EventKind.REPLICA_REJOINED
                         and lost <= set(e.detail.get("replicas", ()))), None)
        out = _first(later, EventKind.REPLICA_LOST)
        return {
            "survivors_told_at": out.detail.get("told_at") if out else None,
            "detected_at": detected.time, "cause": detected.detail.get("cause"),
            "attributed_to": {"nodes": detected.detail.get("nodes"), "ranks": detected.detail.get("ranks")},
            "decision": decision.detail.get("action") if decision else None,
            "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
            "recovery_heard_at": recovered.time if recovered else None,
            "steps_lost": max(0, ev.detail["step"] - detected.detail.get("step", ev.detail["step"])),
            "restored_from": "replica" if rejoined else None,
            "replicas": sorted(lost),
            "rejoined_at": rejoined.detail.get("at", rejoined.time) if rejoined else None,
            "outcome": _outcome(recovered is not None, True, ended.kind if ended else None),
        }
    return {
        "detected_at": detected.time if detected else None,
        "cause": detected.detail.get("cause") if detected else None,
        "attributed_to": ({"nodes": detected.detail.get("nodes"), "ranks": detected.detail.get("ranks")}
                          if detected else None),
        "decision": decision.detail.get("action") if decision else None,
        "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
        "recovery_heard_at": recovered.time if recovered else None,
        # From the step it was injected at back to the step the next attempt started from; none when
        # that is later (a bitflip lands at the rank's next step, and a snapshot of that step that the
        # probes vouch for is loaded).
        "steps_lost": max(0, ev.detail["step"] - resumed_from) if resumed_from is not None else None,
        "restored_from": restored.detail.get("restore_from") if restored else None,
        "outcome": _outcome(recovered is not None, detected is not None, ended.kind if ended else None),
    }


def _collective_fault_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """A collective between replicas failed with nothing lost: detected when a rank says its step
    was discarded, resolved by the epoch the controller published (`resync`), recovered at the
    replicas' first step after it. Nothing is redone but the discarded step. (A fault that became
    a failure after all is reported as one.) A fault armed ahead (`from_step`: the rank held it till
    its step) acts when the first rank discards that step, by that rank's clock."""
    discarded = _first(later, EventKind.REPLICA_STEP_DISCARDED)
    resync = _first(later, EventKind.REPLICA_RESYNC)
    recovered = _first(later, EventKind.FIRST_STEP_AFTER_RECOVERY) if resync else None
    ended = _ended(later)
    if recovered is not None:
        outcome = "recovered"
    elif ended is None:
        outcome = "pending"
    elif ended.kind != EventKind.SUCCEEDED:
        outcome = "cancelled" if ended.kind == EventKind.CANCELLED else "failed"
    elif resync is not None:  # (at the run's last step: no step after it)
        outcome = "recovered"
    else:  # a collective late by less than the timeout discards nothing: the run rides it out
        outcome = "ridden_out" if ev.detail.get("seconds") is not None else "not_detected"
    return {
        "detected_at": discarded.time if discarded else None,
        "cause": "collective" if discarded else None,
        "attributed_to": None,  # (each replica's first rank says its step was discarded: no culprit is named)
        "decision": "resync" if resync else None,
        "resynced_at": resync.time if resync else None,
        "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
        "recovery_heard_at": recovered.time if recovered else None,
        "steps_lost": 0 if recovered else None,
        "restored_from": None,
        "outcome": outcome,
        "acts_at": discarded.detail.get("time") if discarded and "from_step" in ev.detail else None,
    }


def _departure_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """spot-reclaim left in its grace period: the ranks said `terminating` (detected), stopped at a step
    boundary (`drained`), and the next attempt went on from that step without the node."""
    told = _first(later, EventKind.TERMINATING)
    drained = _first(later, EventKind.DRAINED)
    decision, recovered, restored, ended, resumed_from = _aftermath(later)
    return {
        "detected_at": told.time if told else None, "cause": "drained" if drained else None,
        "attributed_to": {"nodes": drained.detail.get("nodes"), "ranks": None} if drained else None,
        "decision": decision.detail.get("action") if decision and drained else None,
        "drained_at": drained.time if drained else None, "drained_step": drained.detail.get("step") if drained else None,
        "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
        "recovery_heard_at": recovered.time if recovered else None,
        "steps_lost": max(0, drained.detail["step"] - resumed_from) if drained and resumed_from is not None else None,
        "restored_from": restored.detail.get("restore_from") if restored else None,
        "outcome": _outcome(recovered is not None, told is not None, ended.kind if ended else None),
    }


def _failed_before(later: list[Event], kind: str) -> bool:
    """Whether a failure was detected before the first event of `kind` (or with none of it)."""
    return next((e.kind for e in later if e.kind in (kind, EventKind.FAILURE_DETECTED)), None) == \
        EventKind.FAILURE_DETECTED


def _failed_first(later: list[Event]) -> bool:
    """Whether a failure was detected before any epoch resolved a discarded step."""
    for e in later:
        if e.kind == EventKind.REPLICA_RESYNC:
            return False
        if e.kind == EventKind.FAILURE_DETECTED:
            return True
    return False


def _slow_rank_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """Detected by the straggler verdict naming the rank; then either reported only, or its node
    replaced at the next checkpoint (no step lost)."""
    rank = int(ev.detail["target"])
    verdict = _first(later, EventKind.STRAGGLER, rank=rank)
    after = later[later.index(verdict) + 1:] if verdict else []
    detected = _first(after, EventKind.FAILURE_DETECTED, cause="straggler")
    decision = _first(after, EventKind.DECISION) if detected else None
    recovered = _first(after, EventKind.FIRST_STEP_AFTER_RECOVERY) if detected else None
    restored = _first(after, EventKind.ATTEMPT_STARTED) if detected else None
    ended = _ended(later)
    if verdict is None:
        outcome = "not_detected" if ended else "pending"
    elif detected is None:
        outcome = "detected"
    else:
        outcome = _outcome(recovered is not None, True, ended.kind if ended else None)
    return {
        "detected_at": verdict.time if verdict else None,
        "cause": "straggler" if verdict else None,
        "attributed_to": ({"nodes": [verdict.detail.get("node")], "ranks": [rank], "score": verdict.detail.get("score"),
                           "steps_to_verdict": verdict.detail.get("step", 0) - ev.detail["step"]}
                          if verdict else None),
        "decision": decision.detail.get("action") if decision else ("report" if verdict else None),
        "recovered_at": recovered.time if recovered else None,
        "steps_lost": (detected.detail.get("step", 0) - restored.detail.get("start_step", 0)
                       if detected and restored else 0),
        "outcome": outcome,
    }


def _outage_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """The outage shows as failed saves (unless retries outlast it); it is over at the first commit
    after it ends."""
    until = float(ev.detail.get("until", ev.time))
    failed = [e for e in later if e.kind == EventKind.CHECKPOINT_FAILED]
    committed = next((e for e in later if e.kind == EventKind.CHECKPOINT_COMMITTED and e.time >= until), None)
    ended = _ended(later)
    return {
        "detected_at": failed[0].time if failed else None,
        "cause": "storage_outage" if failed else None,
        "attributed_to": None,
        "decision": "retry",
        "saves_failed": [e.detail.get("step") for e in failed if committed is None or e.time <= committed.time],
        "recovered_at": committed.time if committed else None,
        "steps_lost": 0,
        "outcome": "recovered" if committed else ("not_recovered" if ended else "pending"),
    }


def _outcome(recovered: bool, detected: bool, ended: str | None) -> str:
    if recovered:
        return "recovered"
    if ended == EventKind.FAILED:
        return "failed"
    if ended == EventKind.CANCELLED:  # stopped by its owner before it recovered: not the fault's doing
        return "cancelled"
    if ended == "succeeded":  # the run ended before it noticed, or resumed at the last step
        return "recovered" if detected else "not_detected"
    return "pending"
