"""The run's timeline: every transition and notable fact, time-stamped, with run and attempt ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    time: float
    """Unix seconds."""
    run_id: str
    """Run the event belongs to."""
    attempt: int
    """Attempt number (0 for run-level events before the first launch)."""
    kind: str
    """submitted, planned, attempt_started, restored, checkpoint_committed, succeeded, failed, ..."""
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
        self._counts: dict[str, int] = {}

    def add(self, now: float, attempt: int, kind: str, **detail: Any) -> Event:
        if self._events and now < self._events[-1].time:
            now = self._events[-1].time
        event = Event(now, self.run_id, attempt, kind, detail)
        self._events.append(event)
        self._counts[kind] = self._counts.get(kind, 0) + 1
        return event

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Put back a timeline read from the registry (before anything else is added)."""
        self._events = [Event(r["time"], self.run_id, r["attempt"], r["kind"], dict(r["detail"])) for r in rows]
        self._counts = {}
        for e in self._events:
            self._counts[e.kind] = self._counts.get(e.kind, 0) + 1

    def count(self, kind: str) -> int:
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

    def kinds(self) -> list[str]:
        return [e.kind for e in self._events]

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self._events if e.kind == kind]
