"""What each rank says after every step, and where it says it (a sink the launcher chooses).

Pure: no torch. The Ray controller passes its own sink; torchrun workers write JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, kw_only=True)
class StepReport:
    rank: int
    """Global rank that reports."""
    attempt: int
    """Attempt of the run this rank belongs to."""
    step: int
    """Number of optimizer steps finished (1 after the first step)."""
    cursor: int
    """Global sample cursor after this step: the whole data state of the run."""
    loss: float | None
    """Mean loss over the global batch; only ranks of the last pipeline stage know it."""
    step_time_s: float
    """Wall time of the step on this rank."""
    data_s: float
    """Building this rank's input batch."""
    compute_s: float
    """This rank's own compute: forward, backward and optimizer, on a clock that stops while it waits
    for peers (a slow rank computes long; its peers wait long)."""
    wait_s: float
    """The rest of the step: waiting in collectives and pipeline receives for slower peers."""
    probe_s: float = 0.0
    """Health probes (integrity checksums, the anomaly all-reduce, periodic SDC checks)."""
    tokens_per_s: float
    """Global tokens per second implied by this rank's step time."""
    end_time: float = 0.0
    """Unix seconds the step ended on this rank (0: not known; the controller then uses when it heard)."""
    snapshot_s: float = 0.0
    """Time the loop was held after the step for a peer snapshot (the copy into host memory)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(line: str) -> "StepReport":
        return StepReport(**json.loads(line))


class ReportSink(Protocol):
    def report(self, report: StepReport) -> None:
        """After every step."""
        ...

    def event(self, kind: str, detail: dict) -> None:
        """A notable fact from a rank (checkpoint_committed, restored, ...)."""
        ...


class JsonlSink:
    """Appends one JSON line per report to a file (one file per rank)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    def report(self, report: StepReport) -> None:
        self._file.write(report.to_json() + "\n")

    def event(self, kind: str, detail: dict) -> None:
        self._file.write(json.dumps({"event": kind, "detail": detail}) + "\n")

    def close(self) -> None:
        self._file.close()


class ListSink:
    """Keeps reports in memory (tests, benchmarks)."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self.events: list[tuple[str, dict]] = []

    def report(self, report: StepReport) -> None:
        self.reports.append(report)

    def event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))
