"""Peer snapshots, the torch side (the rules are checkpointing/peer.py): take them. Loading from them
is trainer/peer_load.py.

`PeerSnapshots.take` copies this rank's whole state into one of its two slots on its node's tmpfs
(the one the previous snapshot is not in): the tensors DCP would save (model and optimizer shards,
laid out by DCP's save plan, which also gives their place in the global tensors) and the
optimizer's other values. The files and the views into them are made once per attempt: a snapshot is
then one copy of each tensor into host memory, the only time the loop waits. A background thread
then checksums the copy, writes its marker, sends it to this rank's buddy on another node in bounded
chunks (and keeps its sender's copy in the same slot of its own), and ends with a barrier over every
rank: past it, every rank's copies of the step are whole on both nodes. Only then are the step's
reports released to the controller (`deliver`), and only then may the next snapshot overwrite the
other slot: a step the controller has heard of is always one the peers can serve, and a node lost at
any moment of an exchange leaves the previous step whole.

The closing barrier is no agreement: a node lost just after it can leave some ranks past it and
others failed in it (the lost ranks' last messages never sent). Past a barrier, every rank had
finished its exchange, so the step is whole on the nodes left; a rank that failed in it must then
not write that step's slot over. So once an exchange or barrier fails, a rank takes no other
snapshot: its next `take` raises `PeerSnapshotFailed` and its attempt ends (a peer is gone; the
training collectives would soon fail too). Seen in the phase test before this rule: rank 0 past the
barrier of step 3, rank 1 failed in it and wrote step 4 over its step 3, and no step was whole.

Host memory: two slots of this rank's state and two of its sender's, 4x the state (the
`peer_snapshots` event measures it once both slots are in use).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from checkpointing.peer import Copy, copy_stem, drop_marker, forget_attempts_before, words_checksum, write_marker
from trainer.checkpoint import trainer_state
from trainer.optim import set_learning_rate
from trainer.report import ReportSink, StepReport


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
    """The optimizers' values a snapshot pickles once per layout. Not the learning rate: the trainer
    sets it before every update from the step (TrainConfig.lr_at), so the one a snapshot holds is
    never used, and a schedule would otherwise lay the state out again at every step."""
    return repr([[{k: v for k, v in g.items() if k not in ("params", "lr")} for g in opt.param_groups]
                 for opt in trainer.optimizers])


def lay_out(trainer: Any) -> tuple[SnapshotLayout, list[bytes]]:
    """This rank's state as DCP's save planner itemises it (names and chunks in global coordinates);
    the tensors are copied at each snapshot, the other values (pickled as DCP does) once. The learning
    rate in them is always train.lr (the step's own is set before each update: `_hyperparameters`), so
    a load on the same mesh finds them byte for byte its own whatever step either was at."""
    rates = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]
    set_learning_rate(trainer.optimizers, trainer.config.train.lr)
    try:
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
    finally:
        for opt, lrs in zip(trainer.optimizers, rates):
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr
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
        self.pinned = False

    def pin(self) -> None:
        """Page-lock the mapping for the GPU (cudaHostRegister): copies into it then run asynchronously
        on a side stream. Where that is refused, copies still work, synchronously."""
        if not self.pinned and self.nbytes:
            error = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(getattr(error, "value", error)) == 0

    def buffer(self) -> memoryview:
        """The bytes, without a copy."""
        return memoryview(self._map)[:self.nbytes]

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


class PeerSnapshotFailed(RuntimeError):
    """A snapshot's exchange failed (a peer is gone): the rank takes no other snapshot this attempt."""


PHASES = ("before_own", "mid_send", "before_buddy_marker", "after_buddy_marker", "released")
"""Points of a snapshot's exchange a test may stop a node at (`PeerSnapshots.on_phase`)."""


class PeerSnapshots:
    """One per rank and attempt. Collective to construct (it makes the group the copies travel on)."""

    chunk_bytes = 64 << 20
    """A copy crosses to the buddy in chunks of at most this many bytes."""

    def __init__(self, *, folder: Path, run_id: str, attempt: int, buddy: list[int] | None, sink: ReportSink,
                 identity: str, mesh: dict[str, int], keep: tuple[int, int] | None = None,
                 on_phase: Callable[[str, int], None] | None = None) -> None:
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
        self.keep = keep
        """(attempt, step) this attempt loaded from peers: older attempts' other copies go at the first snapshot."""
        self.on_phase = on_phase
        """Called with (phase, step) at each of PHASES (fault injection: a node lost at that point)."""
        self._pg = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._layout: SnapshotLayout | None = None
        self._blobs: list[bytes] = []
        self._meta = b""
        """This layout's item index, pickled (the .meta beside each slot)."""
        self._meta_unsent = True
        self._own: list[_Region | None] = [None, None]
        self._own_for: list[SnapshotLayout | None] = [None, None]
        """The layout each own slot's views, values and index were made for."""
        self._views: list[list[torch.Tensor]] = [[], []]
        self._kept: list[_Region | None] = [None, None]
        self._kept_meta: list[bytes | None] = [None, None]
        self._source_meta: bytes | None = None
        """The newest item index the sender sent."""
        self._count = 0
        """Snapshots taken this attempt."""
        self._released = 0
        """Snapshots whose exchange passed its closing barrier."""
        self._whole_slot = 1
        """The slot of the newest snapshot whose exchange passed its closing barrier (whole on both nodes
        for every rank): the next snapshot goes to the other one, even after an exchange that failed."""
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._failed_step = 0
        self._lock = threading.Lock()
        self._sending = False
        self._broken = False
        """The newest snapshot's exchange failed: its step and the steps after it are not reported."""
        self._held: list[Callable[[], None]] = []
        """Reports waiting for the snapshot in flight (`deliver`)."""
        self._made: tuple[SnapshotLayout, list[bytes]] | None = None
        self._stream: Any = None
        """The CUDA stream snapshots are copied on (GPU only)."""
        self.taken: list[int] = []

    def take(self, trainer: Any, reports: Sequence[StepReport] = ()) -> float:
        """Snapshot the trainer's state at its step; the seconds the loop was held (waiting for the last
        snapshot's exchange, if still going, and copying). `reports`: this rank's reports with a loss
        since its previous snapshot; both copies' markers carry them (`Copy.reports`)."""
        t0 = time.perf_counter()
        self.wait()
        if self._error is not None:
            raise PeerSnapshotFailed(f"the peer snapshot of step {self._failed_step} could not be made whole "
                                     f"({self._error}): this attempt ends here, before another snapshot "
                                     "could overwrite a step its peers may hold as whole")
        if self._count == 0:  # what this attempt did not load from an earlier one is of no use now
            forget_attempts_before(self.folder, self.attempt, keep=self.keep)
        if self._layout is None or self._layout.values != _hyperparameters(trainer):
            self._prepare(trainer)
        assert self._layout is not None
        slot = 1 - self._whole_slot
        self._phase("before_own", trainer.step)
        views = self._own_slot(slot)
        copied = None
        if trainer.choice.device.type == "cuda":
            copied = self._copy_from_gpu(trainer, slot, views)
        else:
            for view, source in zip(views, self._layout.sources):
                view.copy_(source)
        self._count += 1
        self.taken.append(trainer.step)
        copy = Copy(attempt=self.attempt, rank=self.rank, world_size=self.world_size, step=trainer.step,
                    cursor=trainer.cursor, mesh=self.mesh, identity=self.identity, role="own",
                    nbytes=self._layout.nbytes, slot=slot,
                    reports=[dataclasses.asdict(r) for r in reports if r.loss is not None])
        with self._lock:
            self._sending = True
        self._thread = threading.Thread(target=self._complete, args=(copy, copied), daemon=True,
                                        name=f"peer-snapshot-{trainer.step}")
        self._thread.start()
        return time.perf_counter() - t0

    def deliver(self, fn: Callable[[], None]) -> None:
        """Call `fn` (a step's report) once the newest snapshot taken is whole on both nodes, for every
        rank: now, or from the snapshot's thread when its closing barrier passes. While the newest
        snapshot is one whose exchange failed (a peer gone), reports are dropped: the controller
        never hears of a step the peers cannot serve."""
        with self._lock:
            if self._sending:
                self._held.append(fn)
                return
            if self._broken:
                return
        fn()

    def _delivered(self, whole: bool) -> None:
        with self._lock:
            self._sending, self._broken = False, not whole
            held, self._held = self._held, []
        if whole:
            for fn in held:
                fn()

    def _phase(self, name: str, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(name, step)

    def adopt_layout(self, made: tuple[SnapshotLayout, list[bytes]] | None) -> None:
        """A layout of this state made already (by a load from peers): the first snapshot uses it."""
        self._made = made

    def _prepare(self, trainer: Any) -> None:
        """Lay the state out (again, only if the optimizer's hyperparameters changed): both slots are
        made anew at their next snapshot."""
        made, self._made = self._made, None
        self._layout, self._blobs = (made if made is not None and made[0].values == _hyperparameters(trainer)
                                     else lay_out(trainer))
        self._meta = pickle.dumps(self._layout.entries)
        self._meta_unsent = True

    def _own_slot(self, slot: int) -> list[torch.Tensor]:
        """The views to copy the state into: the slot's marker goes first (from now on it holds no
        step), its file is mapped and its values and index written if its layout is new."""
        layout = self._layout
        assert layout is not None
        stem = copy_stem(self.attempt, self.rank, "own", slot)
        drop_marker(self.folder, stem)
        if self._own_for[slot] is layout:
            return self._views[slot]
        region = self._own[slot]
        if region is None or region.nbytes != layout.nbytes:
            if region is not None:
                region.close()
            region = self._own[slot] = _Region(self.folder / stem, layout.nbytes)
        views, blobs = [], iter(self._blobs)
        for item, offset, length in layout.entries:
            window = region.tensor[offset:offset + length]
            if item.type == WriteItemType.BYTE_IO:
                window.copy_(torch.frombuffer(bytearray(next(blobs)), dtype=torch.uint8))
            else:
                props = item.tensor_data.properties
                views.append(window.view(props.dtype).view(item.tensor_data.chunk.sizes))
        (self.folder / f"{stem}.meta").write_bytes(self._meta)
        self._views[slot], self._own_for[slot] = views, layout
        return views

    def _copy_from_gpu(self, trainer: Any, slot: int, views: list[torch.Tensor]) -> Any:
        """On a GPU: the copy into the slot's page-locked file runs on a side stream, after the step's
        work; the loop does not wait for it, the next optimizer step does (`Trainer.update_waits`),
        and so does the background thread before it reads the bytes. The event that says it is done."""
        assert self._layout is not None
        region = self._own[slot]
        assert region is not None
        device = trainer.choice.device
        region.pin()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for view, source in zip(views, self._layout.sources):
                view.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        trainer.update_waits.append(done)
        return done

    def _complete(self, copy: Copy, copied: Any = None) -> None:
        """Background: checksum and mark our copy (once the GPU's copy, if any, is done), exchange
        copies with the buddies, then the barrier that makes the step whole everywhere. A failure is
        reported once, and the next `take` raises (a step whose exchange failed is not whole, and
        the other slot, which holds the one before, must stay as it is)."""
        region = self._own[copy.slot]
        assert region is not None
        released = False
        try:
            if copied is not None:
                copied.synchronize()
            copy = dataclasses.replace(copy, checksum=words_checksum(region.buffer()))
            write_marker(self.folder, copy)
            if self._pg is not None:
                if self.to is not None:
                    self._exchange(copy)
                dist.barrier(group=self._pg)  # every rank's copies of the step are whole on both nodes
            self._whole_slot = copy.slot
            self._phase("released", copy.step)
            released = True
            self._released += 1
            if self._released == 1:  # this attempt's first step is whole everywhere: older attempts' copies go
                forget_attempts_before(self.folder, self.attempt)
            if self._released == 2:  # both slots in use: what the snapshots cost in host memory
                self._report_memory(copy.step)
        except Exception as e:  # noqa: BLE001 - a peer gone mid-copy: the attempt is ending anyway
            if self._error is None:
                self._error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                self._failed_step = copy.step
                self.sink.event("peer_snapshot_failed", {"step": copy.step, "error": self._error})
        finally:
            self._delivered(released)

    def _exchange(self, copy: Copy) -> None:
        """Send our copy to our buddy and keep our sender's in the same slot: sizes and checksum first
        (and the item index when it is new, and the reports the marker carries), then the bytes in
        chunks, then the kept copy's marker."""
        assert self._pg is not None and self.to is not None and self.source is not None
        own = self._own[copy.slot]
        assert own is not None
        kept = copy_stem(self.attempt, self.source, "buddy", copy.slot)
        drop_marker(self.folder, kept)
        meta_out = self._meta if self._meta_unsent else b""
        reports_out = json.dumps(copy.reports).encode() if copy.reports else b""
        header_in = torch.empty(4, dtype=torch.int64)
        _pairwise(torch.tensor([copy.nbytes, len(meta_out), copy.checksum, len(reports_out)], dtype=torch.int64),
                  self.to, header_in, self.source, self._pg)
        nbytes, meta_len, checksum, reports_len = (int(v) for v in header_in)
        meta_in = _pairwise_bytes(meta_out, self.to, meta_len, self.source, self._pg)
        if meta_out or meta_len:
            self._meta_unsent = False
        if meta_in:
            self._source_meta = meta_in
        reports_in = _pairwise_bytes(reports_out, self.to, reports_len, self.source, self._pg)
        region = self._kept[copy.slot]
        if region is None or region.nbytes != nbytes:
            if region is not None:
                region.close()
            region = self._kept[copy.slot] = _Region(self.folder / kept, nbytes)
        self._send_chunks(own.tensor, region.tensor, copy.step)
        self._phase("before_buddy_marker", copy.step)
        if self._kept_meta[copy.slot] != self._source_meta:
            assert self._source_meta is not None
            (self.folder / f"{kept}.meta").write_bytes(self._source_meta)
            self._kept_meta[copy.slot] = self._source_meta
        write_marker(self.folder, dataclasses.replace(copy, role="buddy", rank=self.source, nbytes=nbytes,
                                                      checksum=checksum,
                                                      reports=json.loads(reports_in) if reports_in else []))
        self._phase("after_buddy_marker", copy.step)

    def _send_chunks(self, out: torch.Tensor, into: torch.Tensor, step: int) -> None:
        """Our copy to the buddy and our sender's into `into`, `chunk_bytes` at a time (host memory:
        nothing of the state is staged whole a second time on the way)."""
        assert self._pg is not None and self.to is not None and self.source is not None
        size = self.chunk_bytes
        for i, offset in enumerate(range(0, max(out.numel(), into.numel()), size)):
            _pairwise(out[offset:offset + size] if offset < out.numel() else None, self.to,
                      into[offset:offset + size] if offset < into.numel() else None, self.source, self._pg)
            if i == 0:
                self._phase("mid_send", step)

    def _report_memory(self, step: int) -> None:
        """Rank 0 says what every rank's snapshots hold in host memory, against its state."""
        mine = (self.state_bytes(), self.host_bytes())
        sizes: list[Any] = [mine]
        if self._pg is not None:
            sizes = [None] * self.world_size
            dist.all_gather_object(sizes, mine, group=self._pg)
        if self.rank == 0:
            ratios = [host / state for state, host in sizes if state]
            self.sink.event("peer_snapshots", {
                "step": step, "state_bytes": sum(state for state, _ in sizes),
                "host_bytes": sum(host for _, host in sizes),
                "max_host_per_state": max(ratios, default=0.0), "buddy": self.buddy})

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def host_bytes(self) -> int:
        """Bytes of host memory this rank's snapshots hold (its own slots and the ones it keeps)."""
        return sum(region.nbytes for region in (*self._own, *self._kept) if region is not None)

    def state_bytes(self) -> int:
        return self._layout.nbytes if self._layout else 0

    def close(self) -> None:
        self.wait()
        self._views = [[], []]
        for region in (*self._own, *self._kept):
            if region is not None:
                region.close()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None


def _pairwise_bytes(out: bytes, to: int, size_in: int, source: int, group: Any) -> bytes:
    """Send `out` to `to` and receive `size_in` bytes from `source` (each side skipped when empty)."""
    if not out and not size_in:
        return b""
    into = torch.empty(size_in, dtype=torch.uint8) if size_in else None
    _pairwise(torch.frombuffer(bytearray(out), dtype=torch.uint8) if out else None, to, into, source, group)
    return into.numpy().tobytes() if into is not None else b""


def _pairwise(out: torch.Tensor | None, to: int, into: torch.Tensor | None, source: int, group: Any) -> None:
    ops = []
    if out is not None:
        ops.append(dist.P2POp(dist.isend, out, to, group=group))
    if into is not None:
        ops.append(dist.P2POp(dist.irecv, into, source, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
