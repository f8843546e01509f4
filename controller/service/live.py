"""A run as the service holds it: its controller, worker group and driver thread, and the lock that
steps aside while the controller does slow I/O."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

from controller.attempt import WorkerGroup
from controller.service.registry import Registry, Saved
from controller.service.scheduler import Admission, admission, requested_gpus
from controller.spec import RunSpec
from controller.state import RunController
from controller.topology import Topology


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
    team: str = "default"
    """The team it was submitted for (a registry token's; runs from before teams: default)."""
    lock: RunLock = field(default_factory=RunLock)
    saved: Saved = field(default_factory=Saved)
    thread: threading.Thread | None = None
    admitted: bool = False
    closed: bool = False
    view: dict[str, Any] | None = None
    """The Run object as of the last save (what reads return)."""
    reconciling: threading.Thread | None = None
    """The checkpoint index being reconciled with the store, if it is."""
    _verdict: tuple[tuple[RunSpec, Topology, Topology], Admission] | None = None
    """The last admission verdict and the nodes it was reached on (a queued run is planned again only
    when they change, not at every scheduler pass)."""
    _requested: tuple[RunSpec, int] | None = None
    preemption: tuple[Any, tuple[int, ...] | None] | None = None
    """The last preemption looked for on this run's behalf and what it was looked for on (service.py)."""
    wake: threading.Event = field(default_factory=threading.Event)
    """Set to step the run now rather than at its next poll (a stop asked of it, the service stopping)."""

    def __post_init__(self) -> None:
        self.controller.outside_lock = self.lock.released

    def close(self) -> None:
        """Release the run's workers (and with them its GPU slots)."""
        close = getattr(self.group, "close", None) or self.group.shutdown
        try:
            close()
        finally:
            self.closed = True

    def render(self, now: float) -> dict[str, Any]:
        """The Run object as of `now` (under the run's lock)."""
        with self.lock:
            return {**self.controller.to_dict(now, full=False), "team": self.team,
                    "priority": self.controller.spec.priority}

    def reconcile_index(self, registry: Registry, wait_s: float) -> None:
        """Reconcile the registry's checkpoint index with the store (Registry.reconcile_checkpoints) in
        the background, one at a time, waiting at most `wait_s` for it."""
        store = self.controller.checkpoints.store
        if store is None:
            return
        with self.lock:
            thread = self.reconciling
            if thread is None or not thread.is_alive():
                thread = self.reconciling = threading.Thread(
                    target=registry.reconcile_checkpoints, args=(self.controller.run_id, store),
                    name=f"goodput-index-{self.controller.run_id}", daemon=True)
                thread.start()
        thread.join(wait_s)

    def wait_ended(self, *, timeout_s: float | None, on_tick: Callable[[RunController], None] | None,
                   poll_s: float) -> None:
        """Block until the run has ended and its workers are released; on_tick sees the controller each poll."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self.lock:
                if on_tick is not None:
                    on_tick(self.controller)
                if self.controller.state.terminal and self.closed:
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.controller.run_id} did not end in {timeout_s:.0f} s")
            time.sleep(poll_s)

    def requested_gpus(self, total: Topology) -> int:
        """The GPUs the run asks for (its spec's mesh, or planned once on the usable nodes for auto)."""
        spec = self.controller.spec
        if self._requested is None or self._requested[0] is not spec:
            self._requested = (spec, requested_gpus(spec, total))
        return self._requested[1]

    def admission(self, free: Topology, total: Topology) -> Admission:
        """The scheduler's verdict on this queued run (service/scheduler.py), again only when the nodes changed."""
        spec = self.controller.spec  # a resume may bring another
        last = self._verdict
        if last is None or last[0][0] is not spec or last[0][1:] != (free, total):
            last = self._verdict = ((spec, free, total),
                                    admission(spec, free, total, recovering=self.controller.attempt >= 0))
        return last[1]
