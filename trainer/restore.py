"""Load a committed checkpoint into a trainer, reading each byte from the store once.

Rank 0 reads the step's manifest and DCP metadata and hands them to the others. DCP's load plan says which stored
items each rank's shards need; an item more than one rank needs (a tensor replicated over tp, the
optimizer's scalars replicated over dp) is fetched by one of them and sent to the others over the
process group. Each rank fetches its items with ranged reads, the items a file holds back to back in
one request, and checks every item against the digest its writer recorded before it is used. A rank
that finds a bad item fails the load on every rank with CheckpointError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from checkpointing.manifest import CheckpointError, Manifest, check_identity, read_manifest, step_prefix
from checkpointing.store import ObjectStore, StoreError
from trainer.checkpoint import FLAT, materialize_optimizer_state, trainer_state
from trainer.config import state_fingerprint, state_identity
from trainer.exchange import exchange

T = TypeVar("T")
Item = tuple[str, int, int]
"""A stored item: (file relative to the step, offset, length)."""


def load(trainer: Any, store: ObjectStore, manifest: Manifest) -> int:
    """Collective: fill the trainer's model and optimizer from a committed step saved on any mesh.
    The bytes the store sent this rank; CheckpointError (on every rank) when any rank found bytes
    that fail their check, StoreError when the store could not be read."""
    check_identity(manifest, state_fingerprint(trainer.config.model), state_identity(trainer.config.model), store.uri)
    metadata = _shared_metadata(store, manifest)
    reader = StoreReader(store, manifest, metadata)
    if dist.get_rank() == 0:
        reader.bytes_read += len(metadata)
    materialize_optimizer_state(trainer)
    state = trainer_state(trainer)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:
        raise _first_cause(e) from None
    for part, opt in zip(trainer.parts, trainer.optimizers):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, opt, state["optim"], options=FLAT)
    return reader.bytes_read


def _first_cause(e: CheckpointException) -> BaseException:
    """The error a rank raised inside DCP (which gathers them, each with its traceback, into one
    CheckpointException on every rank): a CheckpointError or StoreError as it was, else DCP's."""
    for rank in sorted(e.failures):
        failure = e.failures[rank]
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, (CheckpointError, StoreError)):
            return cause
    return e


def shared_manifest(store: ObjectStore, run_id: str, step: int) -> Manifest:
    """Collective: the step's manifest, read by rank 0 and broadcast (it lists a digest per item of
    every rank: read once, not once per rank)."""
    return _from_rank_0(lambda: read_manifest(store, run_id, step))


def _shared_metadata(store: ObjectStore, manifest: Manifest) -> bytes:
    """Collective: the step's DCP metadata, read by rank 0 (and checked against its digest) and
    broadcast, so the store sends it once rather than once per rank."""
    key = f"{step_prefix(manifest.run_id, manifest.step)}/.metadata"

    def read() -> bytes:
        data = store.get_bytes(key)
        want = manifest.files.get(".metadata", {}).get("sha256")
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise CheckpointError(f"{key} read from {store.uri} fails its sha256 check")
        return data

    return _from_rank_0(read)


def _from_rank_0(read: Callable[[], T]) -> T:
    """Collective: what `read` returns on rank 0, on every rank; its CheckpointError or StoreError
    raised on every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = read()
        except (CheckpointError, StoreError) as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


class StoreReader(FileSystemReader):
    """A DCP storage reader over an ObjectStore that reads only what the load plan asks for, once.

    `prepare_global_plan` (on the coordinator, which sees every rank's plan) gives each item that
    several ranks need to one of them, the least loaded; `read_data` fetches this rank's items (the
    ones a file holds back to back in one ranged request of up to `span_bytes`, a few requests at a
    time), checks each against the digest its writer recorded (a manifest from before item digests:
    the whole file, against the file's), and then sends shared items to the ranks that need them.
    `bytes_read` counts what the store sent this rank."""

    def __init__(self, store: ObjectStore, manifest: Manifest, metadata: bytes, *, span_bytes: int = 64 << 20,
                 parallel: int = 4) -> None:
        super().__init__(step_prefix(manifest.run_id, manifest.step))
        self.store = store
        self.manifest = manifest
        self.prefix = step_prefix(manifest.run_id, manifest.step)
        self.metadata = metadata
        self.span_bytes = span_bytes
        self.parallel = parallel
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = pickle.loads(self.metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _item(self, req: Any) -> Item:
        info = self.storage_data[req.storage_index]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.prefix}/{info.relative_path}: items stored with transforms "
                                  f"{info.transform_descriptors} are not supported")
        return info.relative_path, info.offset, info.length

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """Every plan gets the same {item: (owner, readers)} of the items several ranks need: the
        owner fetches it, the others receive it from the owner."""
        readers: dict[Item, list[int]] = {}
        for rank, plan in enumerate(plans):
            for item in {self._item(req) for req in plan.items}:
                readers.setdefault(item, []).append(rank)
        load = [0] * len(plans)
        for item, ranks in readers.items():
            if len(ranks) == 1:
                load[ranks[0]] += item[2]
        shared: dict[Item, tuple[int, tuple[int, ...]]] = {}
        for item in sorted((i for i, r in readers.items() if len(r) > 1), key=lambda i: (-i[2], i)):
            owner = min(readers[item], key=lambda r: (load[r], r))
            load[owner] += item[2]
            shared[item] = (owner, tuple(readers[item]))
        return [dataclasses.replace(plan, storage_data=shared) for plan in plans]

    def read_data(self, plan: Any, planner: Any) -> Any:
        me = dist.get_rank()
        shared: dict[Item, tuple[int, tuple[int, ...]]] = plan.storage_data or {}
        wanted: dict[Item, list[Any]] = {}
        for req in plan.items:
            wanted.setdefault(self._item(req), []).append(req)
        held: dict[Item, bytes] = {}
        error: Exception | None = None
        try:
            for item, data in self._fetched(sorted(i for i in wanted if i not in shared or shared[i][0] == me)):
                if item in shared:
                    held[item] = data  # used once the others have theirs too
                else:
                    self._apply(planner, item, data, wanted[item])
        except (CheckpointError, StoreError) as e:
            error = e
        if shared:  # every rank has the same `shared`, so every rank takes part in what follows
            errors: list[Exception | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
        for item, data in exchange(shared, held, me).items():
            self._apply(planner, item, data, wanted[item])
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _apply(self, planner: Any, item: Item, data: bytes, reqs: list[Any]) -> None:
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data))
                continue
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointError(f"{self.prefix}/{item[0]}: item at byte {item[1]} holds {tuple(tensor.size())}, "
                                      f"the load plan wants {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    def _fetched(self, items: list[Item]) -> Iterator[tuple[Item, bytes]]:
        """Each item with its checked bytes, fetched span by span, a few spans ahead."""
        with ThreadPoolExecutor(self.parallel, thread_name_prefix="ckpt-read") as pool:
            ahead: list[Future] = []
            for span in self._spans(items):
                ahead.append(pool.submit(self._read_span, *span))
                if len(ahead) > self.parallel:
                    yield from self._counted(ahead.pop(0))
            for future in ahead:
                yield from self._counted(future)

    def _counted(self, future: Future) -> list[tuple[Item, bytes]]:
        pieces, sent = future.result()
        self.bytes_read += sent
        return pieces

    def _spans(self, items: list[Item]) -> list[tuple[str, int, int, list[Item]]]:
        """(file, start, end, items) requests: back-to-back items of a file joined up to `span_bytes`;
        a file without item digests is read whole (its one digest covers only the whole)."""
        spans: list[tuple[str, int, int, list[Item]]] = []
        for item in items:
            rel, offset, length = item
            entry = self.manifest.files.get(rel)
            if entry is None:
                raise CheckpointError(f"{self.prefix}/{rel} is not in the step's manifest")
            whole = "items" not in entry
            start, end = (0, entry["size"]) if whole else (offset, offset + length)
            last = spans[-1] if spans else None
            if last is not None and last[0] == rel and (whole or last[2] == start and end - last[1] <= self.span_bytes):
                spans[-1] = (rel, last[1], max(last[2], end), last[3] + [item])
            else:
                spans.append((rel, start, end, [item]))
        return spans

    def _read_span(self, rel: str, start: int, end: int, items: list[Item]) -> tuple[list[tuple[Item, bytes]], int]:
        """The span's items with their bytes, and the bytes the store sent for them."""
        entry = self.manifest.files[rel]
        digests = {offset: (length, sha) for offset, length, sha in entry.get("items", ())}
        sent = 0
        for tries_left in (1, 0):  # a torn read is read once more before the step is called corrupt
            data = self.store.get_bytes(f"{self.prefix}/{rel}", start, end)
            sent += len(data)
            bad = self._check(rel, start, data, items, entry, digests)
            if bad is None:
                return [(item, data[item[1] - start:item[1] - start + item[2]]) for item in items], sent
            if not tries_left:
                raise CheckpointError(bad)
        raise AssertionError("unreachable")

    def _check(self, rel: str, start: int, data: bytes, items: list[Item], entry: dict,
               digests: dict[int, tuple[int, str]]) -> str | None:
        """Why the span's bytes cannot be used (None: every item matches its digest)."""
        where = f"{self.prefix}/{rel} read from {self.store.uri}"
        if "items" not in entry:
            if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                return f"{where} fails its sha256 check"
            return None
        for _, offset, length in items:
            if digests.get(offset, (None,))[0] != length:
                return f"{where}: the manifest has no digest for the {length} bytes at {offset}"
            if hashlib.sha256(data[offset - start:offset - start + length]).hexdigest() != digests[offset][1]:
                return f"{where}: the {length} bytes at {offset} fail their sha256 check"
        return None
