"""Start N rank processes that rendezvous through a TCPStore hosted by the test process (as the
controller hosts it), run a function in each, and collect what each returns.

The ranks are forked from one warm image, as goodput's own ranks are forked from their warm actor
(controller/ray/rank_actor.py): a fork server, started once per test process, that has imported torch
and the trainer. A spawned rank pays that import itself (about 2.4 s of CPU each, 20 s for 8 ranks
on a 2-core machine), which measures nothing the tests are about; the fork server is a fresh
interpreter (none of the test process's threads, Ray's included), and each rank gets the caller's
environment and working directory as of the call. `start="spawn"` keeps a truly fresh process for a
benchmark that measures one."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

import torch.distributed as dist


WARM_IMAGE = ["torch", "torch.distributed", "trainer.train", "trainer.checkpoint", "tests.dist.harness"]
"""What the fork server imports once, before it forks any rank."""


def _context(start: str) -> Any:
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(WARM_IMAGE)
    return ctx


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, out_dir: str, kwargs: dict,
           env: dict[str, str], cwd: str) -> None:
    import torch

    os.environ.clear()  # a fork server's child has the server's environment, not the caller's
    os.environ.update(env)
    os.chdir(cwd)

    torch.set_num_threads(1)  # as the Ray workers do: one compute thread per rank (torch is imported by now,
    try:                      # so OMP_NUM_THREADS would come too late)
        result: Any = ("ok", fn(rank=rank, world_size=world, store_port=port, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


class Ranks:
    """Rank processes started and not yet waited for: a test that plays the controller kills some
    (every process of a lost node), starts others, and collects what each returned."""

    def __init__(self, fn: Callable[..., Any], world_size: int, *, port: int, start: str = "forkserver",
                 ranks: list[int] | None = None, **kwargs: Any) -> None:
        ctx = _context(start)
        env, cwd = dict(os.environ), os.getcwd()
        self._dir = tempfile.TemporaryDirectory()
        self.ranks = list(range(world_size)) if ranks is None else ranks
        self.procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, self._dir.name, kwargs, env, cwd))
                      for r in self.ranks]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def kill(self) -> None:
        """SIGKILL every one of these processes at once, as a node loss ends them."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()

    def collect(self, timeout_s: float = 300.0, may_die: frozenset[int] = frozenset()) -> list[Any]:
        """Wait for every process (killing any still alive after `timeout_s`); what each returned, in
        `ranks` order (None for a rank in `may_die` that left none); AssertionError naming the ranks
        that failed."""
        for p in self.procs:
            p.join(timeout_s)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        results: list[Any] = []
        errors: list[str] = []
        for r, proc in zip(self.ranks, self.procs):
            path = os.path.join(self._dir.name, f"{r}.pkl")
            if not os.path.exists(path):
                if r in may_die:
                    results.append(None)
                else:
                    errors.append(f"rank {r}: exited with code {proc.exitcode} and no result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        self._dir.cleanup()
        if errors:
            raise AssertionError("ranks failed:\n" + "\n".join(errors))
        return results


def run_ranks(fn: Callable[..., Any], world_size: int, timeout_s: float = 300.0,
              may_die: frozenset[int] = frozenset(), start: str = "forkserver", **kwargs: Any) -> list[Any]:
    """Run fn(rank=, world_size=, store_port=, **kwargs) in world_size processes (forked from the warm
    image, or spawned: `start`). Ranks in `may_die` may exit without a result (fault-injection
    tests); their result is None."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        return Ranks(fn, world_size, port=store.port, start=start, **kwargs).collect(timeout_s, may_die)
    finally:
        del store
