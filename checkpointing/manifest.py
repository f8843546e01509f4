"""Checkpoint layout and commit protocol on a local filesystem.

`{root}/{run_id}/step-{N:08d}/` holds the DCP files plus `manifest.json`, written last (atomically,
by rename): step, attempt, mesh, world size, data cursor, seeds, and size + sha256 of every file. A
step without a valid manifest does not exist; "latest" is found by listing manifests, never from a
mutable pointer. Pure: imports nothing of the project and no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint cannot be used or written; the message says which and why."""


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
    """Relative path -> {size, sha256} of every file of the step except the manifest."""


def step_dir(root: str | Path, run_id: str, step: int) -> Path:
    return Path(root) / run_id / f"step-{step:08d}"


def uri_to_path(uri: str) -> Path:
    """`file://./x` or `file:///abs` or a plain path -> a local path."""
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if "://" in uri:
        raise CheckpointError(f"checkpoint.uri {uri!r}: only file:// is supported by this store")
    return Path(uri)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe_files(directory: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST and not path.name.endswith(".tmp"):
            out[str(path.relative_to(directory))] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def commit(directory: Path, manifest: Manifest) -> Manifest:
    """Describe the step's files and write the manifest last, atomically: this is the commit."""
    final = Manifest(**{**asdict(manifest), "files": describe_files(directory)})
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(final), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return final


def read_manifest(directory: Path) -> Manifest:
    try:
        raw = json.loads((directory / MANIFEST).read_text())
        return Manifest(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{directory}: no valid manifest ({e})") from None


def verify(directory: Path, manifest: Manifest) -> None:
    """Raise CheckpointError when a file is missing, has another size or another sha256."""
    for rel, want in manifest.files.items():
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{directory}: {rel} is missing")
        if path.stat().st_size != want["size"]:
            raise CheckpointError(f"{directory}: {rel} has {path.stat().st_size} bytes, manifest says {want['size']}")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"{directory}: {rel} fails its sha256 check")


def committed_steps(root: str | Path, run_id: str) -> list[tuple[int, Path]]:
    """(step, dir) of every step that has a manifest file, oldest first (not yet verified)."""
    base = Path(root) / run_id
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_verified(root: str | Path, run_id: str) -> tuple[Manifest, Path, list[str]] | None:
    """The newest step whose manifest and files verify, plus why newer steps were skipped."""
    skipped: list[str] = []
    for _, directory in reversed(committed_steps(root, run_id)):
        try:
            manifest = read_manifest(directory)
            verify(directory, manifest)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return manifest, directory, skipped
    return None


def apply_retention(root: str | Path, run_id: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed steps, and uncommitted leftovers older than the
    newest commit (a crashed save). Called only after a commit, so the last good step survives."""
    steps = committed_steps(root, run_id)
    if not steps:
        return []
    newest = steps[-1][0]
    removed = []
    for step, directory in steps[:-keep] if keep < len(steps) else []:
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(step)
    committed = {s for s, _ in steps}
    for child in (Path(root) / run_id).iterdir():
        m = _STEP_DIR.match(child.name)
        if m and int(m.group(1)) < newest and int(m.group(1)) not in committed:
            shutil.rmtree(child, ignore_errors=True)
    return removed
