"""A fake worker group for driving the run controller without Ray or torch."""

from __future__ import annotations

from controller.state import AttemptSpec, GroupStatus, PollResult
from controller.topology import Topology
from trainer.report import StepReport


class ManualClock:
    """Time that moves only when a test says so."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeCluster:
    """A cluster that shows a fixed topology (or what a test sets)."""

    def __init__(self, topology: Topology) -> None:
        self.nodes = topology

    def topology(self) -> Topology:
        return self.nodes


class FakeWorkerGroup:
    def __init__(self, *, fail_start: Exception | None = None) -> None:
        self.started: list[AttemptSpec] = []
        self.shutdowns = 0
        self._pending = PollResult(GroupStatus.RUNNING)
        self._fail_start = fail_start

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
    def finish_steps(self, first: int, last: int, loss: float = 1.0) -> None:
        attempt = self.started[-1].attempt
        for step in range(first, last + 1):
            self._pending.reports.append(StepReport(
                rank=0, attempt=attempt, step=step, cursor=step * 16, loss=loss / step, step_time_s=0.5,
                data_s=0.0, compute_s=0.4, wait_s=0.1, tokens_per_s=1000.0))

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


class FakeInjector:
    def __init__(self, group: FakeWorkerGroup) -> None:
        self.group = group
        self.injected: list[tuple[str, str]] = []

    def inject(self, kind: str, target: str, *, factor: float | None = None, seconds: float | None = None) -> dict:
        self.injected.append((kind, target))
        if kind == "kill-node":
            self.group.lose_node(target)
        elif kind == "kill-rank":
            self.group.kill_rank(int(target))
        return {"pid": 1234}
