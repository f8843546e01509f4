"""A run's state and the error it ended with: what the controller's state machine (controller/state.py)
moves through, and what its views (controller/views.py) and a restarted service read."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RunState(str, enum.Enum):
    PENDING = "pending"
    PLANNING = "planning"
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


@dataclass
class RunError:
    code: str
    message: str
    traceback: str | None = None
    """user_error: what the user's code raised (type, message, innermost frames)."""
