"""Peer snapshots, the torch side (the rules are checkpointing/peer.py): take them, and load from them.

`PeerSnapshots.take` copies this rank's whole state into a file on its node's tmpfs: the tensors DCP
would save (model and optimizer shards, laid out by DCP's save plan, which also gives their place in
the global tensors) and the optimizer's other values. The file and the views into it are made once
per attempt: a snapshot is then one copy of each tensor into host memory, the only time the loop
waits. A background thread then sends the copy to this rank's buddy on another node, which keeps it
in a file of its own, while training goes on (before the exchange, every rank's own copy of the step
is complete: a barrier; before the next snapshot, the thread is waited for).

`load_from_peers` fills a trainer on any mesh from the copies of one step the new attempt's nodes
hold: DCP's load plan, over the merged item index of every old rank, says what each new rank needs;
for each item the least loaded rank on a node that holds a copy reads it from its host memory and
sends it over the process group to the ranks that need it.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.storage import StorageReader

from checkpointing.manifest import CheckpointError
from checkpointing.peer import (
    Copy, PeerPoint, copy_stem, drop_marker, forget_attempts_before, held_copies, write_marker,
)
from trainer.checkpoint import FLAT, materialize_optimizer_state, trainer_state
from trainer.config import state_fingerprint
from trainer.exchange import exchange
from trainer.report import ReportSink


@dataclasses.dataclass
class _Layout:
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


def _lay_out(trainer: Any) -> tuple[_Layout, list[bytes]]:
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
    return _Layout(entries, sources, _hyperparameters(trainer), offset), blobs


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
        self._layout: _Layout | None = None
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
        self._made: tuple[_Layout, list[bytes]] | None = None
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

    def adopt_layout(self, made: tuple[_Layout, list[bytes]] | None) -> None:
        """A layout of this state made already (by a load from peers): the first snapshot uses it."""
        self._made = made

    def _prepare(self, trainer: Any) -> None:
        """Lay the state out and map its file (again, only if the optimizer's hyperparameters changed)."""
        made, self._made = self._made, None
        layout, blobs = made if made is not None and made[0].values == _hyperparameters(trainer) else _lay_out(trainer)
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


# --- loading -----------------------------------------------------------------------------------------

Key = tuple[int, int, int]
"""An item of a snapshot: (old rank, offset, length)."""


@dataclasses.dataclass(frozen=True)
class PeerLoad:
    bytes_received: int
    """Bytes this rank received from other ranks over the process group."""
    bytes_local: int
    """Bytes this rank read from its own node's host memory (for itself or to send)."""
    how: str
    """same mesh (each rank's copy whole, into its tensors) or resharded (DCP's load plan)."""
    layout: tuple[_Layout, list[bytes]] | None = None
    """The state's layout the load made (the attempt's first snapshot need not make it again)."""


def load_from_peers(trainer: Any, folder: Path, point: PeerPoint) -> PeerLoad:
    """Collective: fill the trainer's model and optimizer from the peer snapshots of `point`, on any
    mesh. CheckpointError on every rank when a copy the step needs is on no node of this attempt.

    On the mesh that took the snapshots (a spare in a lost node's place, a killed rank restarted),
    rank r's state is old rank r's snapshot byte for byte: each rank takes its own copy from its
    node's memory, or whole from a rank whose node holds it, and copies it into its tensors along
    its own layout (checked to be the snapshot's). On another mesh DCP's load plan reshards."""
    held = {(c.rank, c.role): c for c in held_copies(folder)
            if (c.attempt, c.step) == (point.attempt, point.step) and c.identity == state_fingerprint(trainer.config.model)}
    files = {old: folder / copy_stem(point.attempt, old, "own" if (old, "own") in held else "buddy") for old, _ in held}
    listing: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listing, {old: (path.stat().st_size, (path.parent / f"{path.name}.meta").stat().st_size)
                                     for old, path in files.items()})
    holders: dict[int, list[int]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for rank, offered in enumerate(listing):
        for old_rank, size in offered.items():
            holders.setdefault(old_rank, []).append(rank)
            sizes[old_rank] = size
    missing = sorted(set(range(point.world_size)) - set(holders))
    if missing:
        raise CheckpointError(f"peer snapshot of step {point.step} (attempt {point.attempt}): no node of this "
                              f"attempt holds a copy of old rank(s) {missing[:8]}")
    materialize_optimizer_state(trainer)
    if point.mesh == trainer.config.mesh.axes() and point.world_size == dist.get_world_size():
        loaded = _load_same_mesh(trainer, files, holders, sizes)
        if loaded is not None:
            dist.barrier()  # every rank has its copy: the holders' copies are no longer being read
            return loaded
    return _load_resharded(trainer, files, holders)


def _load_same_mesh(trainer: Any, files: dict[int, Path], holders: dict[int, list[int]],
                    sizes: dict[int, tuple[int, int]]) -> PeerLoad | None:
    """Each rank's own old copy into its tensors, in place; None (on every rank) when any rank's
    layout differs from its snapshot's (then DCP reshards)."""
    me, world = dist.get_rank(), dist.get_world_size()
    load = [0] * world
    routes: dict[tuple[int, int, int], tuple[int, tuple[int, ...]]] = {}
    for old in range(world):
        length = 8 + sizes[old][1] + sizes[old][0]  # index length, index, bytes
        owner = old if old in holders[old] else min(holders[old], key=lambda r: (load[r], r))
        load[owner] += length
        routes[(old, 0, length)] = (owner, (old,))
    mine: dict[tuple[int, int, int], bytes] = {}
    for key, (owner, _) in routes.items():
        if owner == me:
            path = files[key[0]]
            meta = (path.parent / f"{path.name}.meta").read_bytes()
            mine[key] = len(meta).to_bytes(8, "little") + meta + path.read_bytes()
    got = exchange(routes, mine, me)
    key = next(k for k in routes if k[0] == me)
    blob = got[key]
    meta_len = int.from_bytes(blob[:8], "little")
    entries = pickle.loads(blob[8:8 + meta_len])
    data = memoryview(bytearray(blob))[8 + meta_len:]  # writable: torch wraps it without a warning
    layout, blobs = _lay_out(trainer)
    same = _same_layout(entries, layout, blobs, data)
    verdict = torch.tensor([0 if same else 1], dtype=torch.int64, device=trainer.choice.device)
    dist.all_reduce(verdict)
    if int(verdict.item()):
        return None
    sources = iter(layout.sources)
    for item, offset, length in layout.entries:
        if item.type == WriteItemType.BYTE_IO:
            continue
        props = item.tensor_data.properties
        stored = torch.frombuffer(data, dtype=torch.uint8, count=length, offset=offset)
        next(sources).copy_(stored.view(props.dtype).view(item.tensor_data.chunk.sizes))
    received = len(blob) if routes[key][0] != me else 0
    return PeerLoad(received, sum(len(b) for b in mine.values()), "same mesh", (layout, blobs))


def _same_layout(entries: list[tuple[Any, int, int]], layout: _Layout, blobs: list[bytes], data: memoryview) -> bool:
    """Whether a snapshot's item index is this state's, items and places alike, and its other values
    (the optimizers' hyperparameters) are byte for byte these."""
    if len(entries) != len(layout.entries):
        return False
    blob_iter = iter(blobs)
    for (old, old_offset, old_length), (new, offset, length) in zip(entries, layout.entries):
        if (old.index, old.type, old_offset, old_length) != (new.index, new.type, offset, length):
            return False
        if new.type == WriteItemType.BYTE_IO:
            if bytes(data[offset:offset + length]) != next(blob_iter):
                return False
        elif (old.tensor_data.chunk != new.tensor_data.chunk
              or old.tensor_data.properties.dtype != new.tensor_data.properties.dtype):
            return False
    return True


def _load_resharded(trainer: Any, files: dict[int, Path], holders: dict[int, list[int]]) -> PeerLoad:
    """DCP's load over every old rank's item index: any mesh."""
    me = dist.get_rank()
    metas: dict[int, bytes] = {}
    for old_rank, ranks in holders.items():  # each old rank's item index, read by its first holder and shared
        if ranks[0] == me:
            path = files[old_rank]
            metas[old_rank] = (path.parent / f"{path.name}.meta").read_bytes()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metas)
    entries = {old: pickle.loads(blob) for part in gathered for old, blob in part.items()}
    reader = PeerReader(_merged_metadata(entries), holders, files)
    state = trainer_state(trainer)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:
        for rank in sorted(e.failures):
            failure = e.failures[rank]
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, CheckpointError):
                raise cause from None
        raise
    for part, opt in zip(trainer.parts, trainer.optimizers):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, opt, state["optim"], options=FLAT)
    dist.barrier()  # every rank has its items: the holders' copies are no longer being read
    return PeerLoad(reader.bytes_received, reader.bytes_local, "resharded")


def _merged_metadata(entries: dict[int, list[tuple[Any, int, int]]]) -> Metadata:
    """DCP metadata of the whole step from every old rank's item index: each item's chunk once, with
    every copy of it (a replicated item is in several ranks' snapshots) in `storage_data`."""
    md: dict[str, Any] = {}
    where: dict[MetadataIndex, list[Key]] = {}
    for old_rank in sorted(entries):
        for item, offset, length in entries[old_rank]:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                md.setdefault(fqn, BytesStorageMetadata())
                index = MetadataIndex(fqn)
            else:
                td = item.tensor_data
                tmd = md.setdefault(fqn, TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[]))
                index = MetadataIndex(fqn, td.chunk.offsets)
                if index not in where:
                    tmd.chunks.append(td.chunk)
            where.setdefault(index, []).append((old_rank, offset, length))
    return Metadata(state_dict_metadata=md, storage_data=where, storage_meta=StorageMeta())


class PeerReader(StorageReader):
    """A DCP storage reader over the snapshots the new attempt's nodes hold (see load_from_peers)."""

    def __init__(self, metadata: Metadata, holders: dict[int, list[int]], files: dict[int, Path]) -> None:
        self.metadata = metadata
        self.holders = holders
        """old rank -> the new ranks on nodes that hold a copy of its snapshot."""
        self.files = files
        """old rank -> this node's copy of its snapshot."""
        self.bytes_received = 0
        self.bytes_local = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """For every item some rank needs: the copy to use and the rank that reads and sends it (the
        least loaded rank that holds one); the same table in every plan."""
        readers: dict[MetadataIndex, list[int]] = {}
        for rank, plan in enumerate(plans):
            for req in plan.items:
                ranks = readers.setdefault(req.storage_index, [])
                if rank not in ranks:
                    ranks.append(rank)
        load = [0] * len(plans)
        chosen: dict[MetadataIndex, Key] = {}
        routes: dict[Key, tuple[int, tuple[int, ...]]] = {}
        for index in sorted(readers, key=lambda i: (-self.metadata.storage_data[i][0][2], i.fqn, tuple(i.offset or ()))):
            copies = self.metadata.storage_data[index]
            # A reader that holds a copy reads it itself; else the least loaded holder sends it.
            options = [(rank, key) for key in copies for rank in self.holders.get(key[0], ())]
            if not options:
                raise CheckpointError(f"no rank holds a copy of {index.fqn}")
            local = [o for o in options if o[0] in readers[index]]
            owner, key = min(local or options, key=lambda o: (load[o[0]], o[0], o[1]))
            load[owner] += key[2]
            chosen[index] = key
            routes[key] = (owner, tuple(readers[index]))
        return [dataclasses.replace(plan, storage_data=(chosen, routes)) for plan in plans]

    def read_data(self, plan: Any, planner: Any) -> Any:
        me = dist.get_rank()
        chosen, routes = plan.storage_data
        held: dict[Key, bytes] = {}
        error: Exception | None = None
        try:
            for key, (owner, _) in sorted(routes.items()):
                if owner == me:
                    held[key] = self._read_local(key)
        except (OSError, CheckpointError) as e:
            error = CheckpointError(f"peer snapshot: {e}")
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
        got = exchange(routes, held, me)
        self.bytes_received += sum(k[2] for k in got if k not in held)
        for req in plan.items:
            key = chosen[req.storage_index]
            data = got[key]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data))
                continue
            md: Any = self.metadata.state_dict_metadata[req.storage_index.fqn]
            chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(req.storage_index.offset))
            tensor = torch.frombuffer(bytearray(data), dtype=md.properties.dtype).view(chunk.sizes)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_local(self, key: Key) -> bytes:
        old_rank, offset, length = key
        path = self.files.get(old_rank)
        if path is None:
            raise CheckpointError(f"this node holds no copy of old rank {old_rank}'s snapshot")
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), length, offset)
        if len(data) != length:
            raise CheckpointError(f"{path} is shorter than its marker says")
        self.bytes_local += length
        return data


__all__ = ["PeerSnapshots", "PeerLoad", "PeerReader", "load_from_peers", "forget_attempts_before"]
