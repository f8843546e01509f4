"""Save and load a trainer's model and optimizer with torch.distributed.checkpoint (DCP).

Every rank writes its own shards; names are global FQNs, so a step saved on one mesh loads onto
another. Saving is asynchronous by default: the loop blocks only while DCP stages the state to host
memory; writing, uploading to the object store and the commit run in a background thread. Each rank
uploads its own files and leaves a marker with their digests (whole file, and each item DCP wrote
into it); rank 0 writes the manifest (the commit) when every marker is there. A rank that dies
midway leaves no marker, so no manifest.

Loading is trainer/restore.py.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
)

from checkpointing.fence import check as check_fence
from checkpointing.manifest import (
    CheckpointError, Manifest, apply_retention, commit, describe, is_committed, step_prefix,
    wait_for_ranks, write_rank_marker,
)
from checkpointing.staging import StagingArea
from checkpointing.store import ObjectStore, StoreError, retry_unavailable
from trainer.config import state_fingerprint, state_identity
from trainer.report import ReportSink

T = TypeVar("T")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def trainer_state(trainer: Any) -> dict:
    """{"model": ..., "optim": ...} of every stage module this rank owns, keyed by global names."""
    model: dict = {}
    optim: dict = {}
    for part, opt in zip(trainer.parts, trainer.optimizers):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, opt, options=FLAT))
    return {"model": model, "optim": optim}


def materialize_optimizer_state(trainer: Any) -> None:
    """Give each optimizer the (zero) state its first step would create, without the step's
    arithmetic, so that a load has somewhere to put what it reads. Left to DCP, a fresh optimizer's
    state is made by a whole step on zero gradients, which in a fresh process (DTensor's sharding
    rules not yet cached for any of the update's ops) was half of a restore's time."""
    for opt in trainer.optimizers:
        init = getattr(opt, "_init_group", None)
        if opt.state or init is None:
            continue
        for group in opt.param_groups:
            params = [p for p in group["params"] if p.requires_grad and p.grad is None]
            for p in params:
                p.grad = torch.zeros_like(p)
            try:  # Adam's and AdamW's (a private method: any other shape leaves it to DCP)
                init(group, [], [], [], [], [], [])
            except TypeError:
                opt.state.clear()
            finally:
                for p in params:
                    p.grad = None


class _ReusedBufferStager(BlockingAsyncStager):
    """DCP's blocking stager with its buffer cache, pinned only where there is a GPU to pin for
    (the stock one always pins, which a CPU-only machine cannot)."""

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True)

    def stage(self, state_dict: dict) -> dict:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.state_dict_cache)


class _ItemRecordingWriter(FileSystemWriter):
    """DCP's file writer that keeps where each item landed in this rank's files: (offset, length)
    per file, for the item digests a ranged load checks."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.items: dict[str, list[tuple[int, int]]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        for result in future.wait():
            info = result.storage_data
            self.items.setdefault(info.relative_path, []).append((info.offset, info.length))
        return future


@dataclass
class SaveTiming:
    step: int
    """Step saved."""
    blocked_s: float
    """Time the training loop was blocked (staging, or the whole save when synchronous)."""
    skipped: str | None = None
    """Why nothing was written (the step is already committed, or the store cannot say it is not)."""


class Checkpointer:
    """One per rank and attempt. Collective to construct (it creates the checkpoint process group)."""

    def __init__(self, store: ObjectStore, *, run_id: str, attempt: int, keep: int, sink: ReportSink,
                 staging_dir: Path, use_async: bool = True, commit_timeout_s: float = 300.0,
                 retry_budget_s: float = 30.0) -> None:
        self.store = store
        self.run_id = run_id
        self.attempt = attempt
        self.keep = keep
        self.sink = sink
        self.staging_dir = staging_dir
        self.use_async = use_async
        self.commit_timeout_s = commit_timeout_s
        self.retry_budget_s = retry_budget_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # A separate gloo group: the background save's collectives must not interleave with training's.
        self._pg = dist.new_group(backend="gloo") if use_async else None
        # Staging buffers are allocated once and reused: the loop then only pays for the copy.
        # Safe because a save waits for the previous one before staging again.
        self._stager = _ReusedBufferStager() if use_async else None
        self._thread: threading.Thread | None = None
        self._staging: StagingArea | None = None
        """This rank's folder under `staging_dir` (checkpointing/staging.py), made at its first save to a
        remote store; it sweeps what killed ranks left there."""

    def save(self, trainer: Any) -> SaveTiming:
        self.wait()  # a save still in flight is waited for, not duplicated
        t0 = time.perf_counter()
        prefix = step_prefix(self.run_id, trainer.step)
        refusal = self._refusal(trainer.step)
        if refusal is not None:
            if self.rank == 0:
                self.sink.event("checkpoint_skipped", {"step": trainer.step, "reason": refusal})
            return SaveTiming(step=trainer.step, blocked_s=time.perf_counter() - t0, skipped=refusal)
        in_place = self.store.local_path(prefix)
        local = in_place if in_place is not None else self._staging_area().path / prefix
        local.mkdir(parents=True, exist_ok=True)
        if in_place is not None:  # an uncommitted save of this step by another attempt left files here
            for stale in self._own_files(local).values():
                stale.unlink(missing_ok=True)
        mesh = trainer.config.mesh
        manifest = Manifest(
            run_id=self.run_id, step=trainer.step, attempt=self.attempt,
            mesh=mesh.axes(), world_size=mesh.world_size,
            cursor=trainer.cursor, seeds={"data": trainer.config.data.seed, "init": trainer.config.train.seed},
            identity=state_fingerprint(trainer.config.model), identity_detail=state_identity(trainer.config.model),
        )
        state = trainer_state(trainer)
        future = None
        writer = _ItemRecordingWriter(local)
        if self.use_async:
            future = dcp.async_save(state, storage_writer=writer, process_group=self._pg, async_stager=self._stager)
        else:
            dcp.save(state, storage_writer=writer)
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._finish, args=(future, writer, local, prefix, manifest, t0,
                                                                   in_place is None),
                                        name=f"checkpoint-step-{trainer.step}", daemon=True)
        self._thread.start()
        if not self.use_async:
            self.wait()
            blocked = time.perf_counter() - t0
        return SaveTiming(step=trainer.step, blocked_s=blocked)

    def _refusal(self, step: int) -> str | None:
        """Collective: why no rank may write this step (None: every rank goes ahead). A committed step
        is never written again, not even its shards: rank 0 asks the store once and tells the others."""
        reason: list[str | None] = [None]
        if self.rank == 0:
            try:
                if self._retry(f"check of step {step}", lambda: is_committed(self.store, self.run_id, step)):
                    reason[0] = f"step {step} is already committed; a committed step is never written again"
            except StoreError as e:
                reason[0] = f"cannot tell whether step {step} is already committed, so it is not written: {e}"
        dist.broadcast_object_list(reason, src=0, group=self._pg)
        return reason[0]

    def _own_files(self, local: Path) -> dict[str, Path]:
        """This rank's files of a save in `local`: its DCP shards, and the metadata on rank 0."""
        own = {p.name: p for p in local.iterdir() if re.fullmatch(rf"__{self.rank}_\d+\.distcp", p.name)}
        if self.rank == 0 and (local / ".metadata").exists():
            own[".metadata"] = local / ".metadata"
        return own

    def _staging_area(self) -> StagingArea:
        if self._staging is None:
            self._staging = StagingArea(self.staging_dir, f"{self.run_id}-a{self.attempt}-r{self.rank}")
        return self._staging

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _finish(self, future: Any, writer: _ItemRecordingWriter, local: Path, prefix: str, manifest: Manifest,
                t0: float, staged: bool) -> None:
        """Upload this rank's files and marker (retrying while the store is unavailable, within the
        budget); then every rank learns whether all ranks' files are in, and rank 0 commits only if so.
        A rank that could not write makes the whole step fail at once, not after a commit timeout."""
        error: str | None = None
        try:
            if future is not None:
                future.result()
            own = self._own_files(local)
            if self.rank == 0 and ".metadata" not in own:
                raise CheckpointError(f"{prefix}: DCP wrote no .metadata")
            digests = describe(own, {rel: writer.items.get(rel, []) for rel in own if rel != ".metadata"})
            for rel, path in own.items():
                self._retry(f"upload of {prefix}/{rel}", lambda: self.store.put_file(f"{prefix}/{rel}", path))
            self._retry(f"marker of rank {self.rank}", lambda: write_rank_marker(
                self.store, prefix, self.rank, digests, attempt=self.attempt, world_size=self.world_size))
        except Exception as e:  # noqa: BLE001 - a failed save is an event; training goes on
            error = f"{type(e).__name__}: {e}"
        try:
            errors: list[str | None] = [None] * self.world_size
            try:
                dist.all_gather_object(errors, error, group=self._pg)
            except Exception as e:  # noqa: BLE001 - a rank died mid-save: no commit
                raise CheckpointError(f"could not confirm that all {self.world_size} ranks wrote their shards "
                                      f"(a rank is gone): {str(e).splitlines()[0][:200]}") from None
            if self.rank != 0:
                return
            failed = {rank: e for rank, e in enumerate(errors) if e is not None}
            if failed:
                raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))
            files = wait_for_ranks(self.store, prefix, self.world_size, attempt=self.attempt,
                                   timeout_s=self.commit_timeout_s)
            # a rank of a superseded attempt (back from a partition) commits nothing: Fenced
            self._retry(f"fence check of {prefix}", lambda: check_fence(self.store, self.run_id, self.attempt))
            final = self._retry(f"commit of {prefix}",
                                lambda: commit(self.store, Manifest(**{**manifest.__dict__, "files": files})))
            try:
                removed = apply_retention(self.store, self.run_id, self.keep)
            except StoreError as e:  # the commit stands; old steps go after a later one
                removed = []
                self.sink.event("retention_deferred", {"step": final.step, "error": str(e)})
            self.sink.event("checkpoint_committed", {
                "step": final.step, "uri": f"{self.store.uri}/{prefix}", "bytes": final.total_bytes(),
                "seconds": time.perf_counter() - t0, "removed": removed})
        except Exception as e:  # noqa: BLE001 - a failed save is an event; training goes on
            if self.rank == 0:
                self.sink.event("checkpoint_failed", {"step": manifest.step, "error": str(e)})
        finally:
            if staged:
                shutil.rmtree(local, ignore_errors=True)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return retry_unavailable(what, fn, budget_s=self.retry_budget_s)

    def close(self) -> None:
        self.wait()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None
