"""Failure-injection drills: the injector protocol and the drill report. The report is a pure
function of the run's events, so tests, the CLI and the API read the same figures."""

from __future__ import annotations

from typing import Any, Protocol

from controller.events import Event


class DrillInjector(Protocol):
    def inject(self, kind: str, target: str) -> dict[str, Any]:
        """Do it (kill-node: SIGKILL the node's raylet; kill-rank: SIGKILL a worker; hang-rank: SIGSTOP
        a worker) and say what was hit."""
        ...


def drill_reports(events: list[Event]) -> list[dict[str, Any]]:
    """One report per injected drill: injected_at, detected_at, recovered_at (first step finished on
    the new attempt), steps_lost (work redone since the last commit), decision, outcome."""
    reports = []
    for i, ev in enumerate(events):
        if ev.kind != "drill_injected":
            continue
        later = events[i + 1:]
        detected = next((e for e in later if e.kind == "failure_detected"), None)
        decision = next((e for e in later if e.kind == "decision"), None)
        recovered = next((e for e in later if e.kind == "first_step_after_recovery"), None)
        restored = next((e for e in later if e.kind == "attempt_started"), None)
        ended = next((e for e in later if e.kind in ("failed", "cancelled")), None)
        resumed_from = restored.detail.get("start_step", 0) if restored else None
        report: dict[str, Any] = {
            "kind": ev.detail["drill"], "target": ev.detail.get("target"), "at_step": ev.detail.get("step"),
            "injected_at": ev.time,
            "detected_at": detected.time if detected else None,
            "cause": detected.detail.get("cause") if detected else None,
            "attributed_to": ({"nodes": detected.detail.get("nodes"), "ranks": detected.detail.get("ranks")}
                              if detected else None),
            "decision": decision.detail.get("action") if decision else None,
            "recovered_at": recovered.time if recovered else None,
            "steps_lost": (ev.detail["step"] - resumed_from) if resumed_from is not None else None,
            "outcome": "recovered" if recovered else ("failed" if ended else "pending"),
        }
        if detected:
            report["detection_s"] = detected.time - ev.time
        if recovered:
            report["recovery_s"] = recovered.time - ev.time
        reports.append(report)
    return reports
