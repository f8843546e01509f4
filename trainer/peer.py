"""Peer snapshots, the torch side (the rules are checkpointing/peer.py): take them. Loading from them
is trainer/peer_load.py.

`PeerSnapshots.take` copies this rank's whole state into a file on its node's tmpfs: the tensors DCP
would save (model and optimizer shards, laid out by DCP's save plan, which also gives their place in
the global tensors) and the optimizer's other values. The file and the views into it are made once
per attempt: a snapshot is then one copy of each tensor into host memory, the only time the loop
waits. A background thread then sends the copy to this rank's buddy on another node, which keeps it
in a file of its own, while training goes on (before the exchange, every rank's own copy of the step
is complete: a barrier; before the next snapshot, the thread is waited for).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from checkpointing.peer import Copy, copy_stem, drop_marker, forget_attempts_before, write_marker
from trainer.checkpoint import trainer_state
from trainer.report import ReportSink


@dataclasses.dataclass
class SnapshotLayout:
    """Where each item of this rank's state lies in its snapshot file, and the tensors it copies."""

    entries: list[tuple[Any, int, int]]
    """(DCP WriteItem, offset, length) per item."""
    sources: list[torch.Tensor]
    """The state's tensors (the live ones: the optimizer updates them in place), in `entries` order."""
    values: str
    """The optimizers' hyperparameters when laid out (a change lays the state out again)."""
    nbytes: int


def _hyperparameters(trainer: Any) -> str:
    return repr([[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                 for opt in trainer.optimizers])


def lay_out(trainer: Any) -> tuple[SnapshotLayout, list[bytes]]:
    """This rank's state as DCP's save planner itemises it (names and chunks in global coordinates);
    the tensors are copied at each snapshot, the other values (pickled as DCP does) once."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(trainer_state(trainer), is_coordinator=True)
    plan = planner.create_local_plan()
    entries, sources, blobs = [], [], []
    offset = 0
    for item in plan.items:
        data: Any = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            blob = data.getvalue()
            blobs.append(blob)
            entries.append((item, offset, len(blob)))
            offset += len(blob)
            continue
        tensor = data.detach()
        length = tensor.numel() * tensor.element_size()
        entries.append((item, offset, length))
        sources.append(tensor)
        offset += length
    return SnapshotLayout(entries, sources, _hyperparameters(trainer), offset), blobs


class _Region:
    """A file on the node's tmpfs mapped into this process: host memory that outlives it."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


class PeerSnapshots:
    """One per rank and attempt. Collective to construct (it makes the group the copies travel on)."""

    def __init__(self, *, folder: Path, run_id: str, attempt: int, buddy: list[int] | None, sink: ReportSink,
                 identity: str, mesh: dict[str, int]) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.attempt = attempt
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.sink = sink
        self.identity = identity
        self.mesh = dict(mesh)
        self.buddy = list(buddy) if buddy else None
        self.to = buddy[self.rank] if buddy else None
        self.source = buddy.index(self.rank) if buddy else None
        self._pg = dist.new_group(backend="gloo") if buddy else None
        self._layout: SnapshotLayout | None = None
        self._own: _Region | None = None
        self._views: list[torch.Tensor] = []
        self._kept: _Region | None = None
        self._meta_to_send: bytes | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._first = True
        self._lock = threading.Lock()
        self._sending = False
        self._held: list[Callable[[], None]] = []
        """Reports waiting for the copy in flight (`deliver`)."""
        self._made: tuple[SnapshotLayout, list[bytes]] | None = None
        self.taken: list[int] = []

    @property
    def own_stem(self) -> str:
        return copy_stem(self.attempt, self.rank, "own")

    def take(self, trainer: Any) -> float:
        """Snapshot the trainer's state at its step; the seconds the loop was held (waiting for the last
        copy's transfer, if still going, and copying)."""
        t0 = time.perf_counter()
        self.wait()
        if self._layout is None or self._layout.values != _hyperparameters(trainer):
            self._prepare(trainer)
        assert self._layout is not None and self._own is not None
        drop_marker(self.folder, self.own_stem)
        for view, source in zip(self._views, self._layout.sources):
            view.copy_(source)
        if trainer.choice.device.type == "cuda":
            torch.cuda.synchronize(trainer.choice.device)
        copy = self._copy(trainer, "own", self.rank, self._layout.nbytes)
        write_marker(self.folder, copy)
        self.taken.append(trainer.step)
        if self._pg is None and self._first:  # own copies only (one node): older ones go now
            forget_attempts_before(self.folder, self.attempt)
            self._first = False
        if self._pg is not None:
            with self._lock:
                self._sending = True
            self._thread = threading.Thread(target=self._send_to_buddy, args=(copy,), daemon=True,
                                            name=f"peer-snapshot-{trainer.step}")
            self._thread.start()
        return time.perf_counter() - t0

    def deliver(self, fn: Callable[[], None]) -> None:
        """Call `fn` (a step's report) once every snapshot taken so far is on the buddies: now, or
        from the copying thread when it is done. A step the controller hears of can then be healed
        from peers, and a drill injected on hearing of it cannot land while its copies are being
        rewritten (that window falls back to the store)."""
        with self._lock:
            if self._sending:
                self._held.append(fn)
                return
        fn()

    def _delivered(self) -> None:
        with self._lock:
            self._sending = False
            held, self._held = self._held, []
        for fn in held:
            fn()

    def _copy(self, trainer: Any, role: str, rank: int, nbytes: int) -> Copy:
        return Copy(attempt=self.attempt, rank=rank, world_size=self.world_size, step=trainer.step,
                    cursor=trainer.cursor, mesh=self.mesh, identity=self.identity, role=role, nbytes=nbytes)

    def adopt_layout(self, made: tuple[SnapshotLayout, list[bytes]] | None) -> None:
        """A layout of this state made already (by a load from peers): the first snapshot uses it."""
        self._made = made

    def _prepare(self, trainer: Any) -> None:
        """Lay the state out and map its file (again, only if the optimizer's hyperparameters changed)."""
        made, self._made = self._made, None
        layout, blobs = made if made is not None and made[0].values == _hyperparameters(trainer) else lay_out(trainer)
        drop_marker(self.folder, self.own_stem)
        self._views = []
        if self._own is not None:
            self._own.close()
        self._own = _Region(self.folder / self.own_stem, layout.nbytes)
        blob_iter = iter(blobs)
        for item, offset, length in layout.entries:
            window = self._own.tensor[offset:offset + length]
            if item.type == WriteItemType.BYTE_IO:
                window.copy_(torch.frombuffer(bytearray(next(blob_iter)), dtype=torch.uint8))
            else:
                props = item.tensor_data.properties
                self._views.append(window.view(props.dtype).view(item.tensor_data.chunk.sizes))
        meta = pickle.dumps(layout.entries)
        (self.folder / f"{self.own_stem}.meta").write_bytes(meta)
        self._meta_to_send = meta
        self._layout = layout

    def _send_to_buddy(self, copy: Copy) -> None:
        """Background: once every rank's own copy of the step is complete, send ours to our buddy and
        keep our sender's. A failure is reported once; training goes on (the copies of a step
        with a failed transfer are simply incomplete)."""
        assert self._pg is not None and self._own is not None and self.to is not None and self.source is not None
        try:
            # The barrier: every rank's own copy is complete. It also says whether any rank's layout is
            # new (its first snapshot, or new hyperparameters): only then do sizes and indexes travel.
            meta_out = self._meta_to_send or b""
            changed = torch.tensor([1 if meta_out else 0], dtype=torch.int64)
            dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self._pg)
            kept = copy_stem(self.attempt, self.source, "buddy")
            if int(changed.item()):
                header_out = torch.tensor([copy.nbytes, len(meta_out)], dtype=torch.int64)
                header_in = torch.empty(2, dtype=torch.int64)
                _pairwise(header_out, self.to, header_in, self.source, self._pg)
                nbytes, meta_len = (int(v) for v in header_in)
            else:
                assert self._kept is not None
                nbytes, meta_len = self._kept.nbytes, 0
            drop_marker(self.folder, kept)
            meta_in = torch.empty(meta_len, dtype=torch.uint8)
            if meta_out or meta_len:
                _pairwise(torch.frombuffer(bytearray(meta_out), dtype=torch.uint8) if meta_out else None, self.to,
                          meta_in if meta_len else None, self.source, self._pg)
            self._meta_to_send = None
            if meta_len:
                (self.folder / f"{kept}.meta").write_bytes(meta_in.numpy().tobytes())
            if self._kept is None or self._kept.nbytes != nbytes:
                if self._kept is not None:
                    self._kept.close()
                self._kept = _Region(self.folder / kept, nbytes)
            _pairwise(self._own.tensor, self.to, self._kept.tensor, self.source, self._pg)
            write_marker(self.folder, dataclasses.replace(copy, role="buddy", rank=self.source, nbytes=nbytes))
            if self._first:  # this attempt's copies are complete on every rank: older ones may go
                self._first_complete(copy, nbytes)
        except Exception as e:  # noqa: BLE001 - a peer gone mid-copy: the attempt is ending anyway
            if self._error is None:
                self._error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                self.sink.event("peer_snapshot_failed", {"step": copy.step, "error": self._error})
        finally:
            self._delivered()

    def _first_complete(self, copy: Copy, kept: int) -> None:
        """Once per attempt, when every rank has its first snapshot and its buddy's: older attempts'
        copies leave this node's memory, and rank 0 reports what the snapshots hold."""
        sizes: list[Any] = [None] * self.world_size
        dist.all_gather_object(sizes, (copy.nbytes, kept), group=self._pg)
        forget_attempts_before(self.folder, self.attempt)
        self._first = False
        if self.rank == 0:
            ratios = [(own + kept_) / own for own, kept_ in sizes if own]
            self.sink.event("peer_snapshots", {
                "step": copy.step, "state_bytes": sum(own for own, _ in sizes),
                "host_bytes": sum(own + kept_ for own, kept_ in sizes),
                "max_host_per_state": max(ratios, default=0.0), "buddy": self.buddy})

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._delivered()

    def host_bytes(self) -> int:
        """Bytes of host memory this rank's snapshots hold (its own copy and the one it keeps)."""
        return (self._own.nbytes if self._own else 0) + (self._kept.nbytes if self._kept else 0)

    def state_bytes(self) -> int:
        return self._layout.nbytes if self._layout else 0

    def close(self) -> None:
        self.wait()
        self._views = []
        for region in (self._own, self._kept):
            if region is not None:
                region.close()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None


def _pairwise(out: torch.Tensor | None, to: int, into: torch.Tensor | None, source: int, group: Any) -> None:
    ops = []
    if out is not None:
        ops.append(dist.P2POp(dist.isend, out, to, group=group))
    if into is not None:
        ops.append(dist.P2POp(dist.irecv, into, source, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
