"""Peer snapshots, the rules: who keeps whose copy, what a node holds, and the step a recovery may load
from peers. Pure: no torch (trainer/peer.py takes the snapshots, trainer/peer_load.py loads them).

Every `checkpoint.peer_every_steps` steps each rank copies its whole training state into host memory
on its node (a file on the node's tmpfs, which outlives the rank's process but not the node) and its
buddy, a rank on another node (another rack where there is one), keeps a second copy. Each copy has
two slots, used in turn: a snapshot is written into the slot its predecessor does not hold, so the
previous step stays whole on both nodes until the new one is whole on both (a node lost mid-exchange
loses the step being written, never the one before). Beside each slot a marker says which complete
step it holds and the checksum of its bytes (`words_checksum`); it is removed while the slot is
rewritten, so a slot without its marker does not exist, and a copy whose bytes do not give the
marker's checksum is never loaded. Files of one node, under `{root}/{run key}/` (`run_key`: the run's
id and the time it was created, so that another run under the same id, or another service's run,
never reads these):

    a{attempt}-r{rank}.{own|buddy}{slot}         the bytes of the state rank `rank` of `attempt` had
    a{attempt}-r{rank}.{own|buddy}{slot}.meta    where each item lies in them
    a{attempt}-r{rank}.{own|buddy}{slot}.json    the marker: step, cursor, world, mesh, identity, checksum

A rank reports a snapshot's step to the controller only once every rank's copies of it are whole on
both nodes (trainer/peer.py): with a snapshot every step (the default), a step the controller has
heard of is a step the peers can serve; with one every k steps, the steps between are redone. The
converse can fail: a step whole everywhere whose report died with its rank (or in a survivor's queue
when the attempt was torn down). So the markers of the ranks that know the loss carry the reports of
the steps their snapshot covers, and a recovery that loads the step gives the controller those it
never heard (`PeerPoint.reports`): its record of kept steps has no hole.

A recovery loads from peers only a step of which every rank's copy is complete on a node the new
attempt runs on (the same all-or-nothing rule as a checkpoint's manifest); else from the store. A node
tells the controller what it holds as `Held` records, one per snapshot step, naming the ranks whose
complete copy it keeps (`holdings`): a few records per node rather than a `Copy` per file, so that a
recovery at 131,072 ranks weighs ~16,000 records, not 262,144 copies.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

ROOT_ENV = "GOODPUT_PEER_DIR"
"""Where a node keeps its snapshots; by default /dev/shm/goodput-peer (host memory)."""

_FILE = re.compile(r"^a(?P<attempt>\d+)-r(?P<rank>\d+)\.(?P<role>own|buddy)(?P<slot>[01])\.json$")


def peer_base() -> Path:
    """The folder under which each node keeps its snapshots (a folder per node below it)."""
    configured = os.environ.get(ROOT_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())) / "goodput-peer"


@dataclass(frozen=True)
class Copy:
    """One complete copy of one rank's snapshot, as its marker describes it."""

    attempt: int
    """Attempt that took it."""
    rank: int
    """Rank (of that attempt) whose state it is."""
    world_size: int
    """Ranks of that attempt."""
    step: int
    """Optimizer steps done."""
    cursor: int
    """Global sample cursor at `step`."""
    mesh: dict[str, int]
    """{dp, pp, tp} of that attempt."""
    identity: str
    """Fingerprint of the state's shape (trainer.config.state_fingerprint)."""
    role: str
    """own (kept by the rank's node) or buddy (kept for it by its buddy's node)."""
    nbytes: int
    """Size of the copy."""
    slot: int = 0
    """Which of the copy's two slots holds it (0 or 1)."""
    checksum: int = 0
    """`words_checksum` of its bytes, taken when they were written."""
    reports: list[dict[str, Any]] = field(default_factory=list)
    """The step reports (trainer.report.StepReport fields) with a loss that the rank made since its
    previous snapshot, through this one's step (empty for ranks that do not know the loss)."""

    @property
    def stem(self) -> str:
        return copy_stem(self.attempt, self.rank, self.role, self.slot)


def copy_stem(attempt: int, rank: int, role: str, slot: int) -> str:
    return f"a{attempt}-r{rank}.{role}{slot}"


def run_key(run_id: str, created_at: float) -> str:
    """The folder a run's snapshots live in on every node: its id and a digest of (id, creation time).
    Another run under the same id (a name reused, another service on the same Ray cluster) has
    another key, so it never sees, loads or removes this run's snapshots."""
    token = hashlib.sha256(f"{run_id}@{created_at!r}".encode()).hexdigest()[:12]
    return f"{run_id}-{token}"


def words_checksum(data: memoryview | bytes | bytearray | np.ndarray) -> int:
    """Checksum of a snapshot's bytes: the sum of its little-endian 64-bit words (the tail's bytes
    added one by one), wrapped to a signed 64-bit integer (it travels in an int64 tensor): the
    probes' checksum over raw bytes. Any single flipped bit changes it. A numpy reduction: memory
    speed, and it releases the GIL (a snapshot's background thread computes it while training goes on)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    words = raw[:raw.size - raw.size % 8].view("<i8")
    total = (int(words.sum(dtype=np.int64)) + int(raw[words.size * 8:].sum(dtype=np.int64))) % 2**64
    return total - 2**64 if total >= 2**63 else total


def write_marker(folder: Path, copy: Copy) -> None:
    """Say the copy is complete (atomically: a marker is whole or absent)."""
    tmp = folder / f".{copy.stem}.json.tmp"
    tmp.write_text(json.dumps(asdict(copy)))
    tmp.replace(folder / f"{copy.stem}.json")


def drop_marker(folder: Path, stem: str) -> None:
    """The copy is about to be rewritten: from now on it does not exist."""
    (folder / f"{stem}.json").unlink(missing_ok=True)


def held_copies(folder: Path) -> list[Copy]:
    """The complete copies a node's run folder holds (markers whose file is there at its size; the
    checksum is checked when a copy is loaded, not here: a node answers this at every recovery)."""
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.iterdir()):
        if not _FILE.match(path.name):
            continue
        try:
            copy = Copy(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # a marker being replaced, or not ours
        data = folder / copy.stem
        whole = data.is_file() and data.stat().st_size == copy.nbytes and (folder / f"{copy.stem}.meta").is_file()
        if path.name == f"{copy.stem}.json" and whole:
            found.append(copy)
    return found


def forget_attempts_before(folder: Path, attempt: int, *, keep: tuple[int, int] | None = None) -> None:
    """Remove the copies of attempts before `attempt` (markers first, so none is seen half gone),
    except those of `keep` = (attempt, step): the step the new attempt loaded, until it has a
    snapshot of its own (so that a node holds at most four copies' worth of memory per rank)."""
    if not folder.is_dir():
        return
    kept = {copy.stem for copy in held_copies(folder) if (copy.attempt, copy.step) == keep} if keep else set()
    names = sorted(folder.iterdir(), key=lambda p: not p.name.endswith(".json"))
    for path in names:
        m = re.match(r"^\.?(a(\d+)-r\d+\.(?:own|buddy)[01])", path.name)
        if m and int(m.group(2)) < attempt and m.group(1) not in kept:
            path.unlink(missing_ok=True)


def forget_run(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def node_codes(node_of_rank: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The nodes in order of first appearance, and each rank's index into them (a placement computes
    it once: `buddies` and a simulated cluster's copies both need it, per rank, at 131,072 ranks)."""
    ranks = np.array(node_of_rank, dtype=object)
    if not len(ranks):
        return [], np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])  # runs of one node (a TP group, a node's GPUs)
    runs = ranks[starts].tolist()
    used = list(dict.fromkeys(runs))
    index = {name: i for i, name in enumerate(used)}
    of_run = np.fromiter(map(index.__getitem__, runs), dtype=np.int64, count=len(runs))
    return used, np.repeat(of_run, np.diff(np.r_[starts, len(ranks)]))


def buddies(node_of_rank: list[str] | tuple[str, ...], rack_of_node: dict[str, str], *,
            tries: int = 64, codes: tuple[list[str], np.ndarray] | None = None) -> list[int] | None:
    """rank -> the rank whose node keeps its copy: a permutation in which no rank's buddy shares its
    node, and as few as can share its rack. None when all ranks share one node (no copy could survive
    it). Ranks are ordered by (rack, node, rank) and shifted; the shift nearest half the world that
    keeps every pair on two nodes and has the fewest same-rack pairs wins (with dp outermost and
    replicas rack after rack, half the world away is the same stage of another replica). Shifts are
    tried outward from half the world, `tries` of them at most, stopping at the first with no pair in
    one rack. Computed on numpy columns (131,072 ranks in milliseconds); `codes`: `node_codes` of
    `node_of_rank`, when the caller has them."""
    world = len(node_of_rank)
    used, code = codes if codes is not None else node_codes(node_of_rank)
    if len(used) < 2:
        return None
    racks_used = [rack_of_node.get(n, "") for n in used]
    rack_index = {rack: i for i, rack in enumerate(sorted(set(racks_used)))}
    rack_of_used = np.fromiter(map(rack_index.__getitem__, racks_used), dtype=np.int64, count=len(used))
    position = np.empty(len(used), dtype=np.int64)  # a node's place in (rack, node) order
    position[np.lexsort((np.array(used), rack_of_used))] = np.arange(len(used))
    node = position[code]
    rack = rack_of_used[code]
    order = np.argsort(node, kind="stable")  # by (rack, node), then rank
    half = world // 2
    best: tuple[int, int, np.ndarray] | None = None
    # shifts outward from half the world (the smaller first on a tie); the first `tries` lie within `tries` of it
    near = range(max(1, half - tries), min(world, half + tries + 1))
    for shift in sorted(near, key=lambda s: (abs(s - half), s))[:tries]:
        buddy = np.empty(world, dtype=np.int64)
        buddy[order] = np.roll(order, -shift)
        if (node == node[buddy]).any():
            continue
        same_rack = int((rack == rack[buddy]).sum())
        score = (same_rack, abs(shift - half))
        if best is None or score < best[:2]:
            best = (*score, buddy)
        if same_rack == 0:
            break
    return best[2].tolist() if best is not None else None


def replica_buddies(node_of_rank: list[str] | tuple[str, ...], rack_of_node: dict[str, str],
                    replicas: int) -> list[int] | None:
    """failure_domain replica: each replica's ranks (rank // (world / replicas)) keep each other's
    copies, since a replica's snapshots travel on its own world's group: global rank -> the local rank
    (within its replica) whose node keeps its copy, `buddies` within each replica. None when a replica
    lies on one node (no copy of it could survive that node)."""
    per = len(node_of_rank) // replicas
    out: list[int] = []
    for k in range(replicas):
        local = buddies(node_of_rank[k * per:(k + 1) * per], rack_of_node)
        if local is None:
            return None
        out.extend(local)
    return out


class Held(NamedTuple):
    """What one node holds of one snapshot step: the ranks of attempt `attempt` whose complete copy at
    `step` it keeps, its own ranks' and its buddies' alike (a tuple: cheap to make, to send and to
    read at 131,072 ranks)."""

    attempt: int
    step: int
    cursor: int
    """Global sample cursor at `step`."""
    world_size: int
    mesh: dict[str, int]
    identity: str
    """Fingerprint of the state's shape (trainer.config.state_fingerprint)."""
    ranks: tuple[int, ...]
    """The ranks (of `attempt`) whose copy at `step` the node holds, each once (`holdings` sorts them)."""
    reports: tuple[dict[str, Any], ...] = ()
    """The step reports those copies' markers carry, one per step (the first found), by step."""


def holdings(copies: Iterable[Copy]) -> list[Held]:
    """A node's complete copies as it reports them: one `Held` per snapshot (attempt, step, cursor,
    world, mesh, identity), in the order each first appears."""
    ranks: dict[tuple, set[int]] = {}
    reports: dict[tuple, dict[int, dict[str, Any]]] = {}
    for copy in copies:
        key = (copy.attempt, copy.step, copy.cursor, copy.world_size, tuple(sorted(copy.mesh.items())), copy.identity)
        ranks.setdefault(key, set()).add(copy.rank)
        for report in copy.reports:
            reports.setdefault(key, {}).setdefault(int(report["step"]), report)
    held = []
    for key, found in ranks.items():
        attempt, step, cursor, world, mesh, identity = key
        held.append(Held(attempt, step, cursor, world, dict(mesh), identity, tuple(sorted(found)),
                         tuple(report for _, report in sorted(reports.get(key, {}).items()))))
    return held


class HeldColumns(NamedTuple):
    """What many nodes hold of one snapshot step, as columns: copy i, of rank `ranks[i]`, is kept on
    node `nodes[keeper[i]]`. A simulated cluster answers for 16,384 nodes at once this way: the same
    `Held` records, without a Python object per node on the way to `peer_point`."""

    attempt: int
    step: int
    cursor: int
    world_size: int
    mesh: dict[str, int]
    identity: str
    nodes: Sequence[str]
    keeper: np.ndarray
    ranks: np.ndarray
    reports: tuple[dict[str, Any], ...] = ()


class Holdings(Mapping[str, list[Held]]):
    """node -> its `Held` records, from `HeldColumns`: read a node at a time like any answer (its records
    built once, on first read), or whole and in numpy by `peer_point`."""

    def __init__(self, columns: Iterable[HeldColumns]) -> None:
        self.columns = tuple(columns)
        self._index: dict[int, dict[str, int]] = {}
        """id(column) -> node name -> its index, made on first use (the columns are this object's: their ids hold)."""

    @functools.cached_property
    def _by_node(self) -> dict[str, list[Held]]:
        out: dict[str, list[Held]] = {}
        for c in self.columns:
            if not len(c.keeper):
                continue
            order = np.argsort(c.keeper, kind="stable")
            keeper = c.keeper[order]
            starts = np.flatnonzero(np.r_[True, keeper[1:] != keeper[:-1]])
            ranks = c.ranks[order].tolist()
            for i, b, e in zip(keeper[starts].tolist(), starts.tolist(), [*starts[1:].tolist(), len(order)]):
                out.setdefault(c.nodes[i], []).append(
                    Held(c.attempt, c.step, c.cursor, c.world_size, c.mesh, c.identity, tuple(ranks[b:e]), c.reports))
        return out

    def kept_on(self, column: HeldColumns, nodes: set[str]) -> np.ndarray:
        """Whether each of the column's copies is kept on one of `nodes`."""
        if 4 * len(nodes) >= len(column.nodes):  # (a world's nodes: one pass over the column's, in C)
            return np.fromiter(map(nodes.__contains__, column.nodes), dtype=bool, count=len(column.nodes))[column.keeper]
        index = self._index.get(id(column))  # (a replica's few nodes: looked up by name)
        if index is None:
            index = self._index[id(column)] = dict(zip(column.nodes, itertools.count()))
        on = np.zeros(len(column.nodes), dtype=bool)
        on[[index[n] for n in nodes if n in index]] = True
        return on[column.keeper]

    def __getitem__(self, node: str) -> list[Held]:
        return self._by_node[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_node)

    def __len__(self) -> int:
        return len(self._by_node)


def sender_of(buddy: list[int]) -> list[int]:
    """rank -> the rank whose copy it keeps (the inverse permutation)."""
    out = [0] * len(buddy)
    for rank, keeper in enumerate(buddy):
        out[keeper] = rank
    return out


@dataclass(frozen=True)
class PeerPoint:
    """A step every rank of an attempt has a complete copy of, on nodes a new attempt runs on."""

    attempt: int
    """The attempt that took the snapshots."""
    step: int
    cursor: int
    world_size: int
    mesh: dict[str, int]
    reports: tuple[dict[str, Any], ...] = ()
    """The step reports the step's markers carry (the steps since the snapshot before it, with a loss,
    one per step): the controller keeps those it never heard of."""


def peer_point(held: Mapping[str, Sequence[Held]], *, identity: str, nodes: set[str],
               excluded: Sequence[tuple[int, int]] = ()) -> tuple[PeerPoint | None, str]:
    """The newest snapshot step a new attempt on `nodes` can load from peers, and why not (when None).
    `held`: node -> what it holds (`holdings`, or `Holdings` read in numpy); `excluded`: (attempt, step) pairs after which that
    attempt's snapshots may not be used (an SDC rollback: state taken after the corruption). A step's
    cursor, world and mesh are those the first node in name order reports (`Holdings`: its first
    column of the step)."""
    first: dict[tuple[int, int], Held | HeldColumns] = {}
    parts: dict[tuple[int, int], list[Sequence[int]]] = {}
    reports: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    excluded_steps: set[int] = set()
    after_of: dict[int, float] = {}  # attempt -> its first excluded step less one (a run has an entry per attempt)
    for attempt, after in excluded:
        after_of[attempt] = min(after_of.get(attempt, math.inf), after)
    if isinstance(held, Holdings):  # (in numpy: one pass over the copies)
        for c in held.columns:
            if c.identity != identity or not (asked := held.kept_on(c, nodes)).any():
                continue
            if c.step > after_of.get(c.attempt, math.inf):
                excluded_steps.add(c.step)
                continue
            first.setdefault(key := (c.attempt, c.step), c)
            parts.setdefault(key, []).append(c.ranks[asked])
            for report in c.reports:
                reports.setdefault(key, {}).setdefault(int(report["step"]), report)
    else:
        for node in sorted(nodes.intersection(held)):
            for h in held[node]:
                if h.identity != identity:
                    continue
                if h.step > after_of.get(h.attempt, math.inf):
                    excluded_steps.add(h.step)
                    continue
                ranks = parts.get(key := (h.attempt, h.step))
                if ranks is None:
                    first[key], ranks = h, parts.setdefault(key, [])
                ranks.append(h.ranks)
                for report in h.reports:
                    reports.setdefault(key, {}).setdefault(int(report["step"]), report)
    if not parts:
        if excluded_steps:
            return None, (f"the peer snapshots held (step {max(excluded_steps)}) were taken after the last state "
                          "the probes vouch for")
        return None, "no node of this attempt holds a peer snapshot"
    for attempt, step in sorted(parts, key=lambda key: (key[1], key[0]), reverse=True):
        found = first[attempt, step]
        if not _missing(parts[attempt, step], found.world_size).size:
            return PeerPoint(attempt=attempt, step=step, cursor=found.cursor, world_size=found.world_size,
                             mesh=dict(found.mesh),
                             reports=tuple(r for _, r in sorted(reports.get((attempt, step), {}).items()))), ""
    newest = max(parts, key=lambda key: (key[1], key[0]))
    world = first[newest].world_size
    missing = _missing(parts[newest], world)[:8].tolist()
    return None, (f"the newest peer snapshot (step {newest[1]}) lacks the copies of rank(s) {missing} of "
                  f"{world}: they and their buddies' copies were lost together")


def replica_peer_point(held: Mapping[str, Sequence[Held]], *, identity: str, replica_nodes: Sequence[set[str]],
                       excluded: Sequence[tuple[int, int]] = ()) -> tuple[PeerPoint | None, tuple[int, ...], str]:
    """failure_domain replica: the newest snapshot step some replica of the new attempt can load from
    its own nodes (a replica loads over its own world's group, so only the copies its nodes hold
    count), and the replicas that can (`replica_nodes[k]`: the nodes replica k runs on). The others
    join at the launch and receive a loading replica's state (trainer.replica.CrossReplica.sync).
    Replicas hold the same bytes at the same step (a step commits on every replica or none), so the
    copies a node holds count whichever replica took them."""
    found = [peer_point(held, identity=identity, nodes=nodes, excluded=excluded) for nodes in replica_nodes]
    points = [(k, point) for k, (point, _) in enumerate(found) if point is not None]
    if not points:
        return None, (), "; ".join(dict.fromkeys(why for _, why in found if why)) or "no replica's nodes hold a peer snapshot"
    best = max((point for _, point in points), key=lambda p: (p.step, p.attempt))
    loaders = tuple(k for k, point in points if (point.attempt, point.step) == (best.attempt, best.step))
    return best, loaders, ""


def _missing(parts: list[Sequence[int]], world: int) -> np.ndarray:
    """The ranks of 0..world-1 that none of `parts` names (a mark per rank, in numpy: 262,144 ranks
    named at 131,072 ranks)."""
    listed = [p for p in parts if not isinstance(p, np.ndarray)]
    seen = np.zeros(world + 1, dtype=bool)
    for named in (np.fromiter(itertools.chain.from_iterable(listed), dtype=np.int64, count=sum(map(len, listed))),
                  *(p for p in parts if isinstance(p, np.ndarray))):
        seen[np.clip(np.asarray(named), -1, world)] = True  # (a rank outside 0..world-1 lands on the spare last entry)
    return np.flatnonzero(~seen[:world])
