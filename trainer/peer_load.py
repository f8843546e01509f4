"""Peer snapshots, the torch side: load from them (taking them is trainer/peer.py; the rules are
checkpointing/peer.py).

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.storage import StorageReader

from checkpointing.manifest import CheckpointError
from checkpointing.peer import PeerPoint, drop_marker, held_copies, words_checksum
from trainer.checkpoint import FLAT, materialize_optimizer_state, trainer_state
from trainer.config import state_fingerprint
from trainer.exchange import exchange
from trainer.peer import SnapshotLayout, lay_out

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
    layout: tuple[SnapshotLayout, list[bytes]] | None = None
    """The state's layout the load made (the attempt's first snapshot need not make it again)."""


def load_from_peers(trainer: Any, folder: Path, point: PeerPoint) -> PeerLoad:
    """Collective: fill the trainer's model and optimizer from the peer snapshots of `point`, on any
    mesh. CheckpointError on every rank when a copy the step needs is on no node of this attempt, or
    only in copies whose bytes fail their checksum (such a copy loses its marker: it is never offered
    again; another node's copy of the same rank is used when it is intact).

    On the mesh that took the snapshots (a spare in a lost node's place, a killed rank restarted),
    rank r's state is old rank r's snapshot byte for byte: each rank takes its own copy from its
    node's memory, or whole from a rank whose node holds it, and copies it into its tensors along
    its own layout (checked to be the snapshot's). On another mesh DCP's load plan reshards."""
    files, damaged = _intact_copies(folder, point, state_fingerprint(trainer.config.model))
    listing: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listing, ({old: (path.stat().st_size, (path.parent / f"{path.name}.meta").stat().st_size)
                                      for old, path in files.items()}, damaged))
    holders: dict[int, list[int]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for rank, (offered, _) in enumerate(listing):
        for old_rank, size in offered.items():
            holders.setdefault(old_rank, []).append(rank)
            sizes[old_rank] = size
    missing = sorted(set(range(point.world_size)) - set(holders))
    if missing:
        bad = [name for _, names in listing for name in names]
        raise CheckpointError(f"peer snapshot of step {point.step} (attempt {point.attempt}): no node of this "
                              f"attempt holds an intact copy of old rank(s) {missing[:8]}"
                              + (f"; failed their checksum: {', '.join(bad[:8])}" if bad else ""))
    materialize_optimizer_state(trainer)
    # The snapshots are in host memory and cross in host memory: on a GPU over a gloo group of the
    # load's own, never staged whole in GPU memory on sender and receiver.
    host = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
    try:
        if point.mesh == trainer.config.mesh.axes() and point.world_size == dist.get_world_size():
            loaded = _load_same_mesh(trainer, files, holders, sizes, host)
            if loaded is not None:
                dist.barrier()  # every rank has its copy: the holders' copies are no longer being read
                return loaded
        return _load_resharded(trainer, files, holders, host)
    finally:
        if host is not None:
            dist.destroy_process_group(host)


def _intact_copies(folder: Path, point: PeerPoint, identity: str) -> tuple[dict[int, Path], list[str]]:
    """old rank -> this node's copy of its snapshot at `point` whose bytes give its marker's checksum
    (its own copy first, else the one kept for it), and the copies that failed (their markers gone)."""
    files: dict[int, Path] = {}
    damaged: list[str] = []
    copies = [c for c in held_copies(folder)
              if (c.attempt, c.step) == (point.attempt, point.step) and c.identity == identity]
    for copy in sorted(copies, key=lambda c: (c.rank, c.role != "own")):
        if copy.rank in files:
            continue
        path = folder / copy.stem
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            intact = words_checksum(memoryview(data)) == copy.checksum
        if intact:
            files[copy.rank] = path
        else:
            drop_marker(folder, copy.stem)
            damaged.append(f"{path.parent.parent.name}/{path.name}")
    return files, damaged


def _load_same_mesh(trainer: Any, files: dict[int, Path], holders: dict[int, list[int]],
                    sizes: dict[int, tuple[int, int]], group: Any) -> PeerLoad | None:
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
    got = exchange(routes, mine, me, group)
    key = next(k for k in routes if k[0] == me)
    blob = got[key]
    meta_len = int.from_bytes(blob[:8], "little")
    entries = pickle.loads(blob[8:8 + meta_len])
    data = memoryview(bytearray(blob))[8 + meta_len:]  # writable: torch wraps it without a warning
    layout, blobs = lay_out(trainer)
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


def _same_layout(entries: list[tuple[Any, int, int]], layout: SnapshotLayout, blobs: list[bytes], data: memoryview) -> bool:
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


def _load_resharded(trainer: Any, files: dict[int, Path], holders: dict[int, list[int]], group: Any) -> PeerLoad:
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
    reader = PeerReader(_merged_metadata(entries), holders, files, group)
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

    def __init__(self, metadata: Metadata, holders: dict[int, list[int]], files: dict[int, Path],
                 group: Any = None) -> None:
        self.metadata = metadata
        self.group = group
        """The group the items cross on (gloo on a GPU: host memory to host memory; None: the default)."""
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
        got = exchange(routes, held, me, self.group)
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


__all__ = ["PeerLoad", "PeerReader", "load_from_peers"]
