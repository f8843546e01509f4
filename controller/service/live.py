"""A run as the service holds it: its controller, worker group and driver thread, and the lock that
steps aside while the controller does slow I/O."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from controller.attempt import WorkerGroup
from controller.service.registry import Saved
from controller.state import RunController


class RunLock:
    """A run's lock: re-entrant, and it steps aside while its holder does slow I/O. The controller
    enters `released()` (its `outside_lock`) around store calls, launches, polls, shutdowns and drill
    injections, so a cancel, a drill request or a scrape never waits behind them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, timeout: float = -1) -> bool:
        if not self._lock.acquire(timeout=timeout):
            return False
        self._owner, self._depth = threading.get_ident(), self._depth + 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Let go entirely for the block (a no-op for a thread that does not hold it)."""
        if self._owner != threading.get_ident():
            yield
            return
        depth = self._depth
        self._owner, self._depth = None, 0
        for _ in range(depth):
            self._lock.release()
        try:
            yield
        finally:
            for _ in range(depth):
                self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth


@dataclass
class LiveRun:
    controller: RunController
    seq: int
    group: WorkerGroup
    lock: RunLock = field(default_factory=RunLock)
    saved: Saved = field(default_factory=Saved)
    thread: threading.Thread | None = None
    admitted: bool = False
    closed: bool = False
    view: dict[str, Any] | None = None
    """The Run object as of the last save (what reads return)."""
    reconciling: threading.Thread | None = None
    """The checkpoint index being reconciled with the store, if it is."""

    def __post_init__(self) -> None:
        self.controller.outside_lock = self.lock.released
