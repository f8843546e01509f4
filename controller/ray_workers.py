"""The Ray worker group: one actor per rank, pinned by a placement group to the node the placement
chose, rendezvousing through a TCPStore hosted here in the controller (never in a rank that can
die; a fresh key prefix per attempt)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from controller.state import AttemptSpec, GroupStatus, PollResult
from trainer.report import StepReport
from trainer.worker import WorkerArgs, WorkerSummary


UNRESPONSIVE_S = 3.0
"""A rank that has not answered a drain call for this long counts as unresponsive."""


class RankActor:
    """Runs `trainer.worker.run_worker` for one rank and buffers what it reports. Concurrent
    calls (max_concurrency=4): `run` trains while `drain` hands reports to the controller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: list[StepReport] = []
        self._events: list[tuple[str, dict]] = []

    def where(self) -> dict[str, Any]:
        import os

        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids()}

    def run(self, args: WorkerArgs) -> WorkerSummary:
        import torch

        from trainer.worker import run_worker

        torch.set_num_threads(1)
        return run_worker(args, self)

    # ReportSink
    def report(self, report: StepReport) -> None:
        with self._lock:
            self._reports.append(report)

    def event(self, kind: str, detail: dict) -> None:
        with self._lock:
            self._events.append((kind, detail))

    def drain(self) -> tuple[list[StepReport], list[tuple[str, dict]]]:
        with self._lock:
            out = (self._reports, self._events)
            self._reports, self._events = [], []
        return out


class RayWorkerGroup:
    def __init__(self, *, store_host: str = "127.0.0.1", launch_timeout_s: float = 60.0,
                 collective_timeout_s: float = 120.0) -> None:
        self.store_host = store_host
        self.launch_timeout_s = launch_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._store: Any = None
        self._pg: Any = None
        self.actors: list[Any] = []
        self._runs: list[Any] = []
        self._finished: set[int] = set()
        self._drains: dict[int, tuple[Any, float]] = {}
        self._nodes: set[str] = set()
        self._stopped_pids: list[int] = []

    def start(self, attempt: AttemptSpec) -> None:
        import ray
        import torch.distributed as dist
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._store is None:
            self._store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False)
        placement = attempt.placement
        world = placement.mesh.world_size
        self._pg = placement_group(
            [{"GPU": 1}] * world, strategy="PACK",
            bundle_label_selector=[{"node": node} for node in placement.node_of_rank],
        )
        try:
            ray.get(self._pg.ready(), timeout=self.launch_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the placement group for {world} ranks on nodes {placement.nodes_used()} was not ready in "
                f"{self.launch_timeout_s:.0f} s: those nodes lack free GPU slots") from None
        actor_cls = ray.remote(RankActor)
        self.actors = [
            actor_cls.options(
                num_cpus=0, num_gpus=1, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(world)
        ]
        self._finished = set()
        self._drains = {}
        self._nodes = set(placement.node_of_rank)
        self._runs = [
            actor.run.remote(WorkerArgs(
                rank=rank, world_size=world, store_host=self.store_host, store_port=self._store.port,
                store_prefix=f"{attempt.run_id}/attempt-{attempt.attempt}/", config=attempt.config,
                attempt=attempt.attempt, start_step=attempt.start_step, cursor=attempt.cursor,
                resume_step=attempt.resume_step, collective_timeout_s=self.collective_timeout_s,
                run_id=attempt.run_id, checkpoint_uri=attempt.checkpoint_uri,
                checkpoint_every=attempt.checkpoint_every, checkpoint_auto=attempt.checkpoint_auto,
                checkpoint_keep=attempt.checkpoint_keep, mtbf_s=attempt.mtbf_s,
            ))
            for rank, actor in enumerate(self.actors)
        ]

    def poll(self) -> PollResult:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        result = PollResult(GroupStatus.RUNNING)
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        ready_ids = {r.hex() for r in ready}
        for rank, ref in enumerate(self._runs):
            if rank in self._finished or ref.hex() not in ready_ids:
                continue
            self._finished.add(rank)
            try:
                ray.get(ref)
            except (ActorDiedError, RayActorError):
                result.dead_ranks.add(rank)  # the process is gone: a cause, not a symptom
            except Exception as e:  # noqa: BLE001 - the rank's own error, reported as is
                result.errors[rank] = f"{type(e).__name__}: {e}"
        self._collect(result)
        result.dead_nodes = self._dead_nodes()
        if result.errors or result.dead_ranks or result.dead_nodes:
            result.status = GroupStatus.FAILED
        elif len(self._finished) == len(self._runs):
            result.status = GroupStatus.FINISHED
        return result

    def _collect(self, result: PollResult) -> None:
        """Drain every live rank's reports; a drain still unanswered after UNRESPONSIVE_S marks the
        rank unresponsive (a stopped process cannot answer). One drain in flight per rank."""
        import ray

        now = time.monotonic()
        for rank, actor in enumerate(self.actors):
            if rank not in self._drains and rank not in result.dead_ranks:
                self._drains[rank] = (actor.drain.remote(), now)
        refs = [ref for ref, _ in self._drains.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
        done_ids = {r.hex() for r in done}
        for rank, (ref, issued) in list(self._drains.items()):
            if ref.hex() not in done_ids:
                if now - issued > UNRESPONSIVE_S:
                    result.unresponsive.add(rank)
                continue
            del self._drains[rank]
            try:
                reports, events = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to say
                continue
            result.reports.extend(reports)
            result.events.extend((rank, kind, detail) for kind, detail in events)
        result.reports.sort(key=lambda r: (r.step, r.rank))

    def _dead_nodes(self) -> set[str]:
        """Nodes of this attempt with no alive Ray node carrying their `node` label."""
        import ray

        alive, seen = set(), set()
        for info in ray.nodes():
            name = (info.get("Labels") or {}).get("node")
            if name in self._nodes:
                seen.add(name)
                if info.get("Alive"):
                    alive.add(name)
        return seen - alive

    def stop_rank(self, rank: int) -> int:
        """SIGSTOP one rank's process (the hang-rank drill); shutdown resumes it so Ray can kill it."""
        pid = int(self.where()[rank]["pid"])
        os.kill(pid, signal.SIGSTOP)
        self._stopped_pids.append(pid)
        return pid

    def kill_rank(self, rank: int) -> int:
        """SIGKILL one rank's process (the kill-rank drill)."""
        pid = int(self.where()[rank]["pid"])
        os.kill(pid, signal.SIGKILL)
        return pid

    def where(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.where.remote() for a in self.actors], timeout=60)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for pid in self._stopped_pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._stopped_pids = []
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._runs, self._drains = [], [], {}
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
