"""Checkpoint layout, commit protocol and retention, over any ObjectStore.

`{run_id}/step-{N:08d}/` holds the DCP files plus `manifest.json`, written last with an if-absent
put: step, attempt, mesh, world size, data cursor, seeds, and size + sha256 of every file. A step
without a valid manifest does not exist; "latest" is found by listing manifests, never from a
mutable pointer. Each rank first leaves `_ranks/attempt-A-world-W/rank-R.json` (the digests of the
files it wrote); the committer writes the manifest only when every rank of its attempt has. A step
that has a manifest is never written again. Pure: no torch, no boto3.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from checkpointing.store import AlreadyExists, NotFound, ObjectStore, StoreError

MANIFEST = "manifest.json"
RANKS = "_ranks"
_STEP = re.compile(r"^(?P<run>.+)/step-(?P<step>\d{8})/manifest\.json$")


class CheckpointError(Exception):
    """A checkpoint cannot be used or written; the message says which and why. Only a definite
    answer (a missing or malformed manifest, a missing file, a size or sha256 mismatch) is one: a
    store that cannot be reached raises StoreError, and the step may be good."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    run_id: str
    """Run the checkpoint belongs to."""
    step: int
    """Optimizer steps done when it was taken."""
    attempt: int
    """Attempt that wrote it."""
    mesh: dict[str, int]
    """{dp, pp, tp} of the writing attempt."""
    world_size: int
    """Ranks that wrote shards."""
    cursor: int
    """Global sample cursor: the next step starts at this sample id."""
    seeds: dict[str, int]
    """Seeds of the run (data order, parameter init)."""
    files: dict[str, dict] = field(default_factory=dict)
    """Path relative to the step -> {size, sha256} of every file of the step except the manifest."""
    created_at: float = 0.0
    """Unix seconds of the commit."""
    identity: str = ""
    """Fingerprint of what shapes the state (model, optimizer, layout rules); '' in manifests written
    before it was recorded. A checkpoint of another identity is never loaded."""
    identity_detail: dict = field(default_factory=dict)
    """What the fingerprint was taken of (to say what differs when a load is refused)."""

    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())


class IdentityMismatch(CheckpointError):
    """The checkpoint is whole, but of another model: it is never loaded."""


def check_identity(manifest: Manifest, identity: str, detail: dict, uri: str) -> None:
    """IdentityMismatch, saying what differs, when the manifest records another identity."""
    if not manifest.identity or manifest.identity == identity:
        return
    theirs = manifest.identity_detail.get("model", {}) if manifest.identity_detail else {}
    ours = detail.get("model", {})
    diff = [f"{k} {theirs.get(k)} there, {ours.get(k)} here" for k in sorted(set(theirs) | set(ours))
            if theirs.get(k) != ours.get(k)]
    if manifest.identity_detail and manifest.identity_detail.get("layout") != detail.get("layout"):
        diff.append(f"state layout {manifest.identity_detail.get('layout')} there, {detail.get('layout')} here")
    raise IdentityMismatch(
        f"{uri}/{step_prefix(manifest.run_id, manifest.step)} holds another model's state "
        f"({'; '.join(diff) or manifest.identity + ' vs ' + identity}): it is never loaded into this run. Give "
        "the run another name or checkpoint.uri, or remove those checkpoints if they are no longer wanted")


def step_prefix(run_id: str, step: int) -> str:
    return f"{run_id}/step-{step:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe(paths: dict[str, Path], items: dict[str, list[tuple[int, int]]] | None = None) -> dict[str, dict]:
    """{relative name: {size, sha256[, items]}} of local files. With `items` (name -> the (offset,
    length) of each item written into that file), each item's bytes get a digest of their own,
    `items: [[offset, length, sha256], ...]`, so a reader that needs one item checks it without
    reading the file; one pass over each file makes both digests."""
    items = items or {}
    return {rel: _digest_file(p, items.get(rel)) for rel, p in sorted(paths.items())}


def _digest_file(path: Path, spans: list[tuple[int, int]] | None) -> dict:
    whole = hashlib.sha256()
    parts: list[list] = []
    with open(path, "rb") as f:
        pos = 0
        for offset, length in sorted(spans or ()):
            if offset < pos:
                raise CheckpointError(f"{path}: item at byte {offset} overlaps the one before it")
            whole.update(f.read(offset - pos))
            h = hashlib.sha256()
            left = length
            while left:
                block = f.read(min(left, 1 << 20))
                if not block:
                    raise CheckpointError(f"{path}: item at byte {offset} ({length} bytes) runs past the end of the file")
                h.update(block)
                whole.update(block)
                left -= len(block)
            parts.append([offset, length, h.hexdigest()])
            pos = offset + length
        for block in iter(lambda: f.read(1 << 20), b""):
            whole.update(block)
    out: dict = {"size": path.stat().st_size, "sha256": whole.hexdigest()}
    if spans is not None:
        out["items"] = parts
    return out


def marker_folder(prefix: str, attempt: int, world_size: int) -> str:
    """Where the ranks of one attempt leave their markers for a step. A crashed save of another
    attempt (or another world size) leaves its markers elsewhere, so a commit never mixes them."""
    return f"{prefix}/{RANKS}/attempt-{attempt}-world-{world_size}"


def write_rank_marker(store: ObjectStore, prefix: str, rank: int, files: dict[str, dict], *, attempt: int,
                      world_size: int) -> None:
    body = {"rank": rank, "attempt": attempt, "world_size": world_size, "files": files}
    store.put_bytes(f"{marker_folder(prefix, attempt, world_size)}/rank-{rank}.json", json.dumps(body).encode())


def wait_for_ranks(store: ObjectStore, prefix: str, world_size: int, *, attempt: int, timeout_s: float,
                   poll_s: float = 0.2) -> dict[str, dict]:
    """The file digests of ranks 0..world_size-1 of this attempt, once each has left its marker;
    CheckpointError on timeout (a rank died mid-save: the step stays uncommitted) or when a marker
    is not what this attempt wrote. Markers of other attempts are never read."""
    folder = marker_folder(prefix, attempt, world_size)
    want = {f"{folder}/rank-{rank}.json": rank for rank in range(world_size)}
    deadline = time.monotonic() + timeout_s
    while True:
        present = {o.key for o in store.list(folder + "/")} & want.keys()
        if len(present) == world_size:
            break
        if time.monotonic() > deadline:
            raise CheckpointError(f"{prefix}: only {len(present)} of {world_size} ranks of attempt {attempt} "
                                  f"finished writing within {timeout_s:.0f} s; the step stays uncommitted")
        time.sleep(poll_s)
    files: dict[str, dict] = {}
    for key, rank in sorted(want.items(), key=lambda kv: kv[1]):
        try:
            body = json.loads(store.get_bytes(key))
            claimed = (int(body["rank"]), int(body["attempt"]), int(body["world_size"]))
            own = dict(body["files"])
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{key}: not a rank marker ({e}); the step stays uncommitted") from None
        if claimed != (rank, attempt, world_size):
            raise CheckpointError(f"{key} says rank {claimed[0]} of attempt {claimed[1]} (world {claimed[2]}); "
                                  f"expected rank {rank} of attempt {attempt} (world {world_size})")
        twice = sorted(files.keys() & own.keys())
        if twice:
            raise CheckpointError(f"{prefix}: rank {rank} and an earlier rank both list {twice}")
        files.update(own)
    return files


def is_committed(store: ObjectStore, run_id: str, step: int) -> bool:
    """Whether the step has a manifest object (valid or not): such a step is never written again."""
    key = f"{step_prefix(run_id, step)}/{MANIFEST}"
    return any(o.key == key for o in store.list(key))


def commit(store: ObjectStore, manifest: Manifest) -> Manifest:
    """Write the manifest last, if absent: this is the commit. A second committer of the same step
    (another attempt) gets CheckpointError and changes nothing."""
    final = manifest if manifest.created_at else replace(manifest, created_at=time.time())
    key = f"{step_prefix(manifest.run_id, manifest.step)}/{MANIFEST}"
    try:  # plain JSON fields: vars and the C encoder (no indent), as a simulated run commits 100,000 times
        store.put_bytes(key, json.dumps(vars(final), sort_keys=True).encode(), if_absent=True)
    except AlreadyExists:
        raise CheckpointError(f"step {manifest.step} of {manifest.run_id} is already committed") from None
    return final


def read_manifest(store: ObjectStore, run_id: str, step: int) -> Manifest:
    """The step's manifest; CheckpointError when it is missing or malformed, StoreError (untouched)
    when the store cannot be reached: an outage does not make a good step unusable."""
    key = f"{step_prefix(run_id, step)}/{MANIFEST}"
    try:
        return Manifest(**json.loads(store.get_bytes(key)))
    except NotFound:
        raise CheckpointError(f"{key}: no manifest") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{key}: not a valid manifest ({e})") from None


def verify(store: ObjectStore, manifest: Manifest, *, checksums: bool = True) -> None:
    """Raise CheckpointError when a file is missing, has another size or (checksums) another sha256;
    StoreError when the store cannot say."""
    prefix = step_prefix(manifest.run_id, manifest.step)
    present = {o.key[len(prefix) + 1:]: o.size for o in store.list(prefix + "/")}
    for rel, want in manifest.files.items():
        if rel not in present:
            raise CheckpointError(f"{prefix}: {rel} is missing")
        if present[rel] != want["size"]:
            raise CheckpointError(f"{prefix}: {rel} has {present[rel]} bytes, the manifest says {want['size']}")
        if checksums:
            h = hashlib.sha256()
            chunk = 8 << 20
            try:
                for start in range(0, want["size"], chunk):
                    h.update(store.get_bytes(f"{prefix}/{rel}", start, min(start + chunk, want["size"])))
            except NotFound:
                raise CheckpointError(f"{prefix}: {rel} is missing") from None
            if h.hexdigest() != want["sha256"]:
                raise CheckpointError(f"{prefix}: {rel} fails its sha256 check")


def committed_steps(store: ObjectStore, run_id: str) -> list[int]:
    """Steps that have a manifest object, oldest first (not yet verified)."""
    steps = []
    for obj in store.list(f"{run_id}/"):
        m = _STEP.match(obj.key)
        if m and m.group("run") == run_id:
            steps.append(int(m.group("step")))
    return sorted(steps)


def latest_verified(store: ObjectStore, run_id: str, *, below: int | None = None, checksums: bool = True
                    ) -> tuple[Manifest, list[str]] | None:
    """The newest step (optionally below a step) whose manifest and files verify, plus why newer
    steps were skipped. Only a verified mismatch skips a step; a StoreError (the store cannot be
    reached) propagates, so the caller waits for the store instead of rolling back past a good step.
    `checksums=False` checks one listing's names and sizes and reads no file. A step a superseded
    attempt committed after its successor started is skipped (checkpointing/fence.py)."""
    from checkpointing.fence import fenced_out, starts

    skipped: list[str] = []
    for step in reversed(committed_steps(store, run_id)):
        if below is not None and step >= below:
            continue
        try:
            manifest = read_manifest(store, run_id, step)
            started = starts(store, run_id, after=manifest.attempt)  # (the attempts that could fence it out)
            if (later := fenced_out(step, manifest.attempt, started)) is not None:
                raise CheckpointError(f"step {step} of {run_id} was committed by attempt {manifest.attempt} after "
                                      f"attempt {later} superseded it (started from step {started[later]}): fenced out")
            verify(store, manifest, checksums=checksums)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return manifest, skipped
    return None


class ForeignCheckpoints(CheckpointError):
    """A new run found checkpoints it did not write under its id: it refuses rather than load them."""


def resume_point(store: ObjectStore, run_id: str, *, identity: str, identity_detail: dict,
                 not_before: float | None = None) -> tuple[Manifest, list[str]] | None:
    """The checkpoint a new attempt of `run_id` loads, checked to be this run's: the model's identity
    must match (IdentityMismatch), and with `not_before` (a new run's creation time) a checkpoint
    committed earlier is another run's (ForeignCheckpoints). Its bytes are not read here: a step's
    digests were taken when its ranks wrote it, each loading rank checks the bytes it reads against
    them, and a step that fails that check is rejected (`Discards.reject`). Here one listing checks
    that every file is there at its size."""
    found = latest_verified(store, run_id, checksums=False)
    if found is None:
        return None
    manifest = found[0]
    if not_before is not None and manifest.created_at < not_before:
        raise ForeignCheckpoints(
            f"{store.uri}/{run_id}/ already holds checkpoints committed before this run was submitted (the "
            f"newest: step {manifest.step}, attempt {manifest.attempt}, at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created_at))}): a new run does not "
            f"carry on another run's work by accident. To continue from them on purpose: goodput resume "
            f"{run_id}; to start afresh: submit again (the service picks an id with an empty prefix) or remove them")
    check_identity(manifest, identity, identity_detail, store.uri)
    return found


def discard_after(store: ObjectStore, run_id: str, step: int) -> list[int]:
    """Committed steps newer than `step` may hold corrupted state: make them invisible, then delete
    them; the steps discarded. Call it with every rank stopped. StoreError when the store cannot be reached."""
    newer = [s for s in committed_steps(store, run_id) if s > step]
    for s in newer:
        discard_step(store, run_id, s)
    return newer


def discard_step(store: ObjectStore, run_id: str, step: int) -> None:
    """Make a step invisible (its manifest goes first, so it is never half-visible), then delete its files."""
    prefix = step_prefix(run_id, step)
    store.delete_prefix(f"{prefix}/{MANIFEST}")
    store.delete_prefix(prefix + "/")


SDC_DISCARD = "committed after step {step}, when silent data corruption may already have begun"


class Discards:
    """The discards a run owes its store before its next attempt reads it: a resume to an older step
    (`resume_to`), an SDC rollback (`roll_back`: commits after the last step the probes vouch for). A
    store that does not answer loses none of them: each is owed until the store took it, and the steps
    it removed (with why) are kept until `take_done` hands them over for the timeline."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.resume_at: int | None = None
        self.rollback: int | None = None
        self.rejected: dict[int, str] = {}
        """Steps a loading rank found corrupt (step -> why), owed until the store took them."""
        self._done: list[tuple[int, str]] = []

    def resume_to(self, step: int | None) -> None:
        self.resume_at = step

    def roll_back(self, store: ObjectStore | None, through: int) -> list[tuple[int, str]]:
        """Discard commits after `through` now if the store answers (the steps and why), else owe it
        (the next `settle` does it, before any checkpoint is chosen). Call it with every rank stopped."""
        if store is None:
            return []
        self.rollback = min(through, self.rollback if self.rollback is not None else through)
        try:
            steps = discard_after(store, self.run_id, self.rollback)
        except StoreError:
            return []
        reason, self.rollback = SDC_DISCARD.format(step=self.rollback), None
        return [(step, reason) for step in steps]

    def reject(self, store: ObjectStore | None, step: int, why: str) -> list[tuple[int, str]]:
        """A rank found bytes of `step` that fail their digest: the step is never loaded again. It goes
        now if the store answers (the step and why), else before the next launch reads (`settle`)."""
        if store is None:
            return []
        self.rejected[step] = f"a rank loading it found it corrupt: {why}"
        try:
            discard_step(store, self.run_id, step)
        except StoreError:
            return []
        return [(step, self.rejected.pop(step))]

    def settle(self, store: ObjectStore) -> None:
        """Do every discard still owed; StoreError when the store cannot be reached (what was done stays done)."""
        for step in sorted(self.rejected):
            discard_step(store, self.run_id, step)
            self._done.append((step, self.rejected.pop(step)))
        if self.resume_at is not None:
            reason = f"the run was resumed from step {self.resume_at}"
            self._done += [(s, reason) for s in discard_after(store, self.run_id, self.resume_at)]
            self.resume_at = None
        if self.rollback is not None:
            reason = SDC_DISCARD.format(step=self.rollback)
            self._done += [(s, reason) for s in discard_after(store, self.run_id, self.rollback)]
            self.rollback = None

    def take_done(self) -> list[tuple[int, str]]:
        """The steps `settle` discarded, with why, since the last call."""
        done, self._done = self._done, []
        return done


def index_changes(store: ObjectStore, run_id: str, indexed: set[int]) -> tuple[list[Manifest], list[int]]:
    """What an index of a run's checkpoints (a service's registry) is missing and what it lists that
    the store no longer holds: (manifests of committed steps not indexed, indexed steps gone). A step
    whose manifest cannot be read is left out (it is not a checkpoint). StoreError propagates."""
    in_store = set(committed_steps(store, run_id))
    missing = []
    for step in sorted(in_store - indexed):
        try:
            missing.append(read_manifest(store, run_id, step))
        except CheckpointError:
            continue
    return missing, sorted(indexed - in_store)


@functools.lru_cache(maxsize=64)
def _step_key(run_id: str) -> re.Pattern:
    """A key under one of the run's steps: (step, the rest of the key)."""
    return re.compile(rf"^{re.escape(run_id)}/step-(\d{{8}})/(.*)$")


def apply_retention(store: ObjectStore, run_id: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed steps, and uncommitted leftovers older than the
    newest commit (crashed saves). Called only after a commit, so the last good step survives."""
    step_of = _step_key(run_id)
    seen: set[int] = set()
    committed: set[int] = set()
    for o in store.list(f"{run_id}/"):  # one listing for both
        if (m := step_of.match(o.key)) is not None:
            seen.add(int(m.group(1)))
            if m.group(2) == MANIFEST:
                committed.add(int(m.group(1)))
    if not committed:
        return []
    steps = sorted(committed)
    removed = steps[:-keep] if keep < len(steps) else []
    leftovers = [s for s in sorted(seen - committed) if s < steps[-1]]
    for step in removed + leftovers:
        store.delete_prefix(step_prefix(run_id, step) + "/")
    return removed
