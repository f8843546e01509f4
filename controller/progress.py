"""Turning per-rank step reports into what a person watches: a progress bar and a final summary."""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from controller.accounting import StepSpan
from trainer.report import StepReport


RECENT = 10_000
"""Samples kept for the summary's medians."""


@dataclass
class RunProgress:
    """Folds step reports of all ranks into per-step facts (loss from the last pipeline stage)."""

    history: list[dict] = field(default_factory=list)
    """One entry per kept step: {step, loss, attempt, start, end} (start/end: Unix seconds, when known)."""
    step_times: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    """The newest RECENT steps' times (the summary's medians are of recent steps: memory stays bounded)."""
    tokens_per_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    compute_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    """The newest RECENT per-rank compute times (one per rank and step)."""
    wait_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    spans: list[StepSpan] = field(default_factory=list)
    """Every execution of every step, kept or later redone (what goodput accounting needs)."""
    committed: int = 0
    """Step of the checkpoint the current attempt started from (steps up to it are done, reported or not)."""
    snapshot_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    """The newest RECENT peer snapshot stalls (one per snapshot step, from the rank that reports the loss)."""
    snapshots: int = 0
    """Peer snapshot stalls recorded in all (`snapshot_s` keeps the newest)."""

    def restore(self, history: list[dict]) -> None:
        """Put back the kept steps a registry holds (the executions later redone are not kept there)."""
        self.history = [dict(h) for h in history]
        self.spans = [StepSpan(h["step"], h["attempt"], h["start"], h["end"]) for h in self.history
                      if h.get("start") is not None and h.get("end") is not None]

    def add(self, report: StepReport, heard_at: float | None = None) -> bool:
        """Record a report; True when it finished a new step (it carries the loss). `heard_at` stands
        in for a report's unknown end time."""
        self.compute_s.append(report.compute_s)
        self.wait_s.append(report.wait_s)
        if report.loss is None:
            return False
        at = len(self.history)  # where the step goes in the history
        if self.history and self.history[-1]["step"] >= report.step:
            if self.history[-1]["attempt"] == report.attempt:
                # The same attempt never goes back: this is a step heard of already, from a second
                # last-stage rank (another dp/tp coordinate), or one whose first report comes after the
                # next step's (a rank's report waits for its peer snapshot's copy: one rank's step k
                # can be heard after another's k + 1). Not a rollback: a step no rank heard of yet
                # goes in its place.
                while at > 0 and self.history[at - 1]["attempt"] == report.attempt \
                        and self.history[at - 1]["step"] > report.step:
                    at -= 1
                if at > 0 and self.history[at - 1]["step"] == report.step \
                        and self.history[at - 1]["attempt"] == report.attempt:
                    return False
            else:  # a step redone by a later attempt (a rollback): what came after it is lost
                while self.history and self.history[-1]["step"] >= report.step:  # kept steps are in order
                    self.history.pop()
                at = len(self.history)
        entry: dict = {"step": report.step, "loss": report.loss, "attempt": report.attempt}
        end = report.end_time or heard_at
        if end is not None:
            start = end - report.step_time_s
            before = self.history[at - 1] if at > 0 else None
            if (report.end_time and before is not None and before["attempt"] == report.attempt
                    and before.get("end") is not None):
                # Consecutive steps may be reported by different ranks (the first report of a step wins,
                # and a peer snapshot's report waits for its copy): one rank's step can seem to start
                # before another's previous step ended. A step starts no earlier than the last ended.
                # (Reports without an end time all end when heard: their spans say nothing to clamp.)
                start = min(max(start, before["end"]), end)
            entry.update(start=start, end=end)
            self.spans.append(StepSpan(report.step, report.attempt, start, end))
        self.history.insert(at, entry)
        if report.snapshot_s:
            self.snapshot_s.append(report.snapshot_s)
            self.snapshots += 1
        self.step_times.append(report.step_time_s)
        self.tokens_per_s.append(report.tokens_per_s)
        return True

    def add_unheard(self, reports: Sequence[dict]) -> list[int]:
        """Keep the reports a loaded peer snapshot carries (`PeerPoint.reports`) for the steps after the
        last one heard of: they ran, their state is what training goes on from, but their reports
        never came (their rank died before sending, or the attempt's teardown dropped them). The
        steps kept, in order."""
        kept = []
        known = {f.name for f in dataclasses.fields(StepReport)}
        for fields in sorted(reports, key=lambda r: r["step"]):
            last = self.history[-1]["step"] if self.history else 0
            report = StepReport(**{k: v for k, v in fields.items() if k in known})
            if report.step > max(last, self.committed) and self.add(report):
                kept.append(report.step)
        return kept

    def has_stepped(self, attempt: int) -> bool:
        """Whether `attempt` has finished a step (the newest kept step is its own)."""
        return bool(self.history) and self.history[-1]["attempt"] == attempt

    @property
    def step(self) -> int:
        return max(self.history[-1]["step"] if self.history else 0, self.committed)

    @property
    def loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None

    def summary(self) -> dict:
        def med(xs: deque) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "steps": self.step,
            "first_loss": self.history[0]["loss"] if self.history else None,
            "final_loss": self.loss,
            "median_step_s": med(self.step_times),
            "median_tokens_per_s": med(self.tokens_per_s),
            "median_compute_s": med(self.compute_s),
            "median_wait_s": med(self.wait_s),
            "median_snapshot_s": med(self.snapshot_s),
        }
