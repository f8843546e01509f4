"""Fakes for driving the run controller without Ray or torch: a worker group, a cluster, a clock, a
drill injector, and a store that fails or is slow on purpose."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from checkpointing.store import StoreError
from controller.attempt import AttemptSpec, GroupStatus, PollResult
from controller.drills import DrillKind
from controller.topology import Topology
from trainer.report import StepReport


class ManualClock:
    """Time that moves only when a test says so."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def drive(controller: Any, until: Any, advance: Callable[[float], object] | None = None, t: float = 101.0, *,
          limit: int = 300) -> float:
    """Step `controller` (or call `advance(t)`) once a second from `t` until its state is `until`;
    returns the next time. A run that ends elsewhere or never gets there fails the test with its last
    events, instead of looping until the suite's timeout."""
    advance = advance or controller.step
    for _ in range(limit):
        if controller.state is until:
            return t
        if controller.state.terminal:
            break
        advance(t)
        t += 1
    if controller.state is until:
        return t
    last = [(e.kind, e.detail) for e in controller.events.view()[-3:]]
    raise AssertionError(f"the run is {controller.state.value}, not {until.value}, after {limit} steps: {last}")


class FakeCluster:
    """A cluster that shows a fixed topology (or what a test sets)."""

    def __init__(self, topology: Topology) -> None:
        self.nodes = topology

    def topology(self, within_s: float | None = None) -> Topology:
        return self.nodes


class FakeWorkerGroup:
    def __init__(self, *, fail_start: Exception | None = None) -> None:
        self.started: list[AttemptSpec] = []
        self.shutdowns = 0
        self._pending = PollResult(GroupStatus.RUNNING)
        self._fail_start = fail_start
        self.stop_requests: list[tuple[str, str]] = []

    # -- what the controller calls
    def start(self, attempt: AttemptSpec) -> None:
        if self._fail_start is not None:
            error, self._fail_start = self._fail_start, None
            raise error
        self.started.append(attempt)

    def fail_next_start(self, error: Exception) -> None:
        self._fail_start = error

    def poll(self) -> PollResult:
        result, self._pending = self._pending, PollResult(GroupStatus.RUNNING)
        return result

    def shutdown(self) -> None:
        self.shutdowns += 1

    def close(self) -> None:
        self.closed = True
        self.shutdown()

    # -- what tests inject
    def finish_steps(self, first: int, last: int, loss: float = 1.0, *, end: float | None = None) -> None:
        """Rank 0 reports steps first..last of 0.5 s each; with `end`, back to back ending then (else
        their end is when the controller hears of them)."""
        attempt = self.started[-1].attempt
        for step in range(first, last + 1):
            self._pending.reports.append(StepReport(
                rank=0, attempt=attempt, step=step, cursor=step * 16, loss=loss / step, step_time_s=0.5,
                data_s=0.0, compute_s=0.4, wait_s=0.1, tokens_per_s=1000.0,
                end_time=0.0 if end is None else end - (last - step) * 0.5))

    def emit(self, rank: int, kind: str, **detail: object) -> None:
        self._pending.events.append((rank, kind, dict(detail)))

    def error_worker(self, rank: int, message: str) -> None:
        self._pending.status = GroupStatus.FAILED
        self._pending.errors[rank] = message

    def complete(self) -> None:
        self._pending.status = GroupStatus.FINISHED

    def lose_node(self, node: str) -> None:
        self._pending.status = GroupStatus.FAILED
        self._pending.dead_nodes.add(node)

    def kill_rank(self, rank: int) -> None:
        self._pending.status = GroupStatus.FAILED
        self._pending.dead_ranks.add(rank)

    def request_stop(self, keep: str, reason: str) -> None:
        """The controller asks the ranks to stop at their next step boundary (trainer/stop.py)."""
        self.stop_requests.append((keep, reason))

    def stop_at(self, step: int) -> None:
        """The ranks stopped after `step` as asked, its state kept as asked, every rank returned."""
        keep, reason = self.stop_requests[-1]
        self.emit(0, "stopped_at_boundary", step=step, kept=keep, reason=reason)
        self.complete()


class FakeInjector:
    arms_ahead: frozenset[DrillKind] = frozenset()

    def __init__(self, group: FakeWorkerGroup) -> None:
        self.group = group
        self.injected: list[tuple[str, str]] = []
        self.params: list[dict[str, Any]] = []

    def inject(self, kind: str, target: str, **params: Any) -> dict:
        self.injected.append((kind, target))
        self.params.append(params)
        if kind == "kill-node":
            self.group.lose_node(target)
        elif kind == "kill-rank":
            self.group.kill_rank(int(target))
        return {"pid": 1234}


class FlakyStore:
    """An ObjectStore over another that fails every call while `down` (as an unreachable S3 does after
    its retries: StoreError) and can take `delay_s` per call (a slow store)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.down = False
        self.delay_s = 0.0
        self.calls = 0

    def _call(self, what: str) -> None:
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.down:
            raise StoreError(f"{what} on {self.uri} failed for 30.0 s (retried within a 30 s budget): "
                             "Could not connect to the endpoint URL")

    def put_file(self, key: str, path: Path) -> None:
        self._call(f"upload of {key}")
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._call(f"put of {key}")
        self.inner.put_bytes(key, data, if_absent=if_absent)

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._call(f"get of {key}")
        return self.inner.get_bytes(key, start, end)

    def download(self, key: str, path: Path) -> None:
        self._call(f"download of {key}")
        self.inner.download(key, path)

    def list(self, prefix: str, *, start_after: str = "") -> list:
        self._call(f"list of {prefix}")
        return self.inner.list(prefix, start_after=start_after)

    def delete_prefix(self, prefix: str) -> None:
        self._call(f"delete under {prefix}")
        self.inner.delete_prefix(prefix)

    def local_path(self, key: str) -> Path | None:
        return None


class FakeReplicaGroup(FakeWorkerGroup):
    """A worker group that can go on without a replica (`failure_domain: replica`), as the Ray one can:
    it records the replicas it is told are out and stops nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[tuple[list[int], tuple[str, ...]]] = []

    def contains_replicas(self) -> bool:
        return bool(self.started)

    def lose_replicas(self, replicas: list[int], nodes: tuple[str, ...], *, suspect: bool = False) -> float:
        self.lost.append((list(replicas), nodes))
        return 0.0
