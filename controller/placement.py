"""`place`: map every rank of a mesh to (node, gpu). Pure and deterministic.

Rules, in order:
- each TP group (tp consecutive ranks) sits inside one node, on consecutive GPUs;
- the pp stages of one pipeline (one dp replica) sit on nodes of one rack where the rack has room,
  stage after stage on the same node or the next node of the rack;
- dp is outermost: replicas are laid out rack after rack;
- spare, lost, quarantined and excluded nodes get no rank.
The result is columnar (one tuple per attribute, indexed by rank) so that 100k ranks stay cheap.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from checkpointing.peer import buddies, node_codes, replica_buddies
from controller.topology import NodeState, Topology
from trainer.config import MeshShape


class PlacementError(ValueError):
    """The usable nodes cannot hold the mesh; the message gives the numbers."""


@dataclass(frozen=True)
class Placement:
    mesh: MeshShape
    node_of_rank: tuple[str, ...]
    """Node name of each global rank."""
    gpu_of_rank: tuple[int, ...]
    """GPU index on its node of each global rank."""
    rack_of_node: dict[str, str]
    """Rack of every node used, and of no other node."""
    spares: tuple[str, ...]
    """Nodes held back for replacement."""

    def rows(self) -> Iterator[dict]:
        """{rank, dp, pp, tp, node, rack, gpu} per rank (the REST/CLI form). The same placement gives the
        same (shared, not to be edited) rows: a 16k-rank run restarted on its nodes lists them once."""
        return iter(_rows(self.mesh, self.node_of_rank, self.gpu_of_rank,
                          tuple(sorted(self.rack_of_node.items()))))

    def columns(self) -> dict[str, Any]:
        """The placement as an `attempt_started` event records it, one entry per TP group (place() puts
        each on consecutive GPUs of one node): {tp, node: [node of each group], gpu: [its first GPU],
        rack: [its node's rack]}, groups in rank order. One dict per rank cost ~70 ms and ~10 MB of JSON
        per attempt at 131,072 ranks, and a 54-day run there has ~3,000 attempts."""
        return {**self._group_columns, "rack": list(self._group_columns["rack"])}

    @functools.cached_property
    def _group_columns(self) -> dict[str, Any]:
        """`columns`, once per placement (a one-to-one swap derives its racks from these)."""
        tp = self.mesh.tp
        nodes = self.node_of_rank[::tp]
        return {"tp": tp, "node": nodes, "gpu": self.gpu_of_rank[::tp],
                "rack": tuple(map(self.rack_of_node.__getitem__, nodes))}

    @classmethod
    def recorded(cls, recorded: dict[str, Any] | list[dict], mesh: MeshShape, spares: list[str]) -> "Placement":
        """The Placement an `attempt_started` event recorded: its TP groups' columns, or (events
        recorded before columns) its rows."""
        if isinstance(recorded, list):
            ordered = sorted(recorded, key=lambda r: r["rank"])
            return cls(mesh=mesh, node_of_rank=tuple(r["node"] for r in ordered),
                       gpu_of_rank=tuple(int(r["gpu"]) for r in ordered),
                       rack_of_node={r["node"]: r["rack"] for r in ordered}, spares=tuple(spares))
        tp = int(recorded["tp"])
        return cls(mesh=mesh, node_of_rank=tuple(n for n in recorded["node"] for _ in range(tp)),
                   gpu_of_rank=tuple(int(g) + t for g in recorded["gpu"] for t in range(tp)),
                   rack_of_node=dict(zip(recorded["node"], recorded["rack"])), spares=tuple(spares))

    @functools.cached_property
    def node_codes(self) -> tuple[list[str], np.ndarray]:
        """The nodes used in order of first appearance, and each rank's index into them (once per
        placement: who keeps whose peer copy, and a simulated cluster's copies, go by it)."""
        return node_codes(self.node_of_rank)

    def peer_buddies(self, *, replicas: bool = False) -> tuple[int, ...] | None:
        """rank -> the rank whose node keeps its peer copy (checkpointing/peer.py `buddies`; within each
        replica when `replicas`), None when no copy could outlive a node. Once per placement: a restart
        on the same nodes places the same way, a one-to-one swap keeps them (`swap_nodes`), and at
        131,072 ranks they take ~15 ms."""
        if replicas not in self._buddies:
            buddy = (replica_buddies(self.node_of_rank, self.rack_of_node, self.mesh.dp_replicas) if replicas
                     else buddies(self.node_of_rank, self.rack_of_node, codes=self.node_codes))
            self._buddies[replicas] = tuple(buddy) if buddy else None
        return self._buddies[replicas]

    def peer_keepers(self, *, replicas: bool = False) -> np.ndarray | None:
        """`peer_buddies` as global ranks in numpy: rank -> the global rank whose node keeps its copy (a
        replica's buddies are its own local ranks)."""
        if replicas not in self._keepers:
            buddy = self.peer_buddies(replicas=replicas)
            keepers = None
            if buddy is not None:
                keepers = np.fromiter(buddy, dtype=np.int64, count=len(buddy))
                if replicas:
                    per = len(buddy) // self.mesh.dp_replicas
                    keepers += np.arange(len(buddy)) // per * per
            self._keepers[replicas] = keepers
        return self._keepers[replicas]

    @functools.cached_property
    def _buddies(self) -> dict[bool, tuple[int, ...] | None]:
        return {}

    @functools.cached_property
    def _keepers(self) -> dict[bool, np.ndarray | None]:
        return {}

    def __getstate__(self) -> dict[str, Any]:
        """Its fields only: what it computed once (node codes, buddies: arrays of the world's size) is
        computed again where it is needed, not shipped with every AttemptSpec sent to a rank."""
        return {f: self.__dict__[f] for f in self.__dataclass_fields__}

    def nodes(self) -> set[str]:
        """The nodes used (`nodes_used` without the sort)."""
        return set(self.rack_of_node)

    def nodes_used(self) -> list[str]:
        return sorted(self.rack_of_node)  # exactly the nodes used: no pass over the ranks

    def ranks_on(self, node: str) -> list[int]:
        return ranks_on(self.node_of_rank, (node,))

    def replica_nodes(self) -> list[set[str]]:
        """The nodes each data-parallel replica runs on (replica k: ranks k*R .. (k+1)*R - 1)."""
        per = self.mesh.world_size // self.mesh.dp_replicas
        return [set(self.node_of_rank[k * per:(k + 1) * per]) for k in range(self.mesh.dp_replicas)]


def ranks_on(node_of_rank: tuple[str, ...], nodes: "Iterable[str]") -> list[int]:
    """The ranks on these nodes, in order, from an index of the placement's ranks by node built once per
    placement (attribution asks at every poll while a lost node's signal is in, and a replica contained
    at 131,072 ranks asks ~40 times per failure: a search of the ranks per call cost 18 of a 54-day
    simulation's 100 s)."""
    index = rank_index(node_of_rank)
    out: list[int] = []
    for node in nodes:
        out.extend(index.get(node))
    return sorted(out)


class RankIndex:
    """{node: its ranks, ascending} of one placement. Asked rarely (a world path's one question per
    failure) it searches the ranks (~1 ms at 131,072 ranks); asked often (attribution at every poll, a
    contained replica ~40 times per failure) it builds the index once (~18 ms) and answers from it. A
    placement with a few nodes swapped (a replica formed again on a spare) derives its index as the
    changes over its source's, not a copy of 16,384 nodes' entries; a chain of changes is flattened once
    it grows long."""

    _SEARCHES_BEFORE_BUILD = 16
    _FLATTEN_AFTER = 32

    def __init__(self, node_of_rank: tuple[str, ...], base: dict[str, list[int]] | None = None,
                 changes: dict[str, list[int]] | None = None) -> None:
        self._ranks = node_of_rank
        self._base = base
        self._changes = changes or {}
        self._searches = 0

    def get(self, node: str) -> list[int]:
        ranks = self._changes.get(node)
        if ranks is not None:
            return ranks
        if self._base is None:
            self._searches += 1
            if self._searches <= self._SEARCHES_BEFORE_BUILD:
                return _search(self._ranks, node)
            self._base = _build(self._ranks)
        return self._base.get(node, [])

    def with_changes(self, node_of_rank: tuple[str, ...], changes: dict[str, list[int]]) -> "RankIndex":
        """The index of `node_of_rank`: this one's placement with `changes` ({node: its ranks now})."""
        if self._base is None:  # a placement that moves nodes is asked often (a replica path): build now
            self._base = _build(self._ranks)
        merged = {**self._changes, **changes}
        if len(merged) <= self._FLATTEN_AFTER:
            return RankIndex(node_of_rank, self._base, merged)
        flat = {**self._base, **merged}
        return RankIndex(node_of_rank, {node: ranks for node, ranks in flat.items() if ranks})


def _search(node_of_rank: tuple[str, ...], node: str) -> list[int]:
    out: list[int] = []
    at = -1
    while True:
        try:
            at = node_of_rank.index(node, at + 1)  # in C
        except ValueError:
            return out
        out.append(at)


def _build(node_of_rank: tuple[str, ...]) -> dict[str, list[int]]:
    n = len(node_of_rank)  # a node's ranks are runs: the run starts found in C, then one step per run
    starts = [0, *itertools.compress(range(1, n), map(operator.ne, node_of_rank[1:], node_of_rank[:-1]))] if n else []
    index: dict[str, list[int]] = {}
    for begin, end in zip(starts, [*starts[1:], n]):
        index.setdefault(node_of_rank[begin], []).extend(range(begin, end))
    return index


_INDEXES: dict[int, tuple[tuple[str, ...], RankIndex]] = {}
_INDEXES_KEPT = 8
_INDEXES_LOCK = threading.Lock()


def rank_index(node_of_rank: tuple[str, ...]) -> RankIndex:
    """The index of this placement's ranks by node (shared: not to be edited). Kept for the last few
    placements by identity: a placement's tuple is made once (`place` caches it per topology) and never
    edited."""
    hit = _INDEXES.get(id(node_of_rank))
    if hit is not None and hit[0] is node_of_rank:
        return hit[1]
    return _remember(node_of_rank, RankIndex(node_of_rank))


def _remember(node_of_rank: tuple[str, ...], index: RankIndex) -> RankIndex:
    with _INDEXES_LOCK:  # (a service's runs and its API threads place and ask at once)
        while len(_INDEXES) >= _INDEXES_KEPT:
            del _INDEXES[next(iter(_INDEXES))]  # the oldest (insertion order)
        _INDEXES[id(node_of_rank)] = (node_of_rank, index)  # the tuple is held, so its id is not reused
    return index


def recorded_nodes(recorded: dict[str, Any] | list[dict]) -> set[str]:
    """The nodes of a placement as an `attempt_started` event recorded it (columns, or older rows)."""
    return {r["node"] for r in recorded} if isinstance(recorded, list) else set(recorded["node"])


@functools.lru_cache(maxsize=8)
def _rows(mesh: MeshShape, node_of_rank: tuple[str, ...], gpu_of_rank: tuple[int, ...],
          rack_items: tuple[tuple[str, str], ...]) -> tuple[dict, ...]:
    racks = dict(rack_items)
    dp_key, pp_key, tp_key = mesh.rank_coords(0)  # the coordinates' names, in their order
    tp, per_replica = mesh.tp, mesh.pp * mesh.tp
    return tuple({"rank": rank, dp_key: rank // per_replica, pp_key: rank % per_replica // tp, tp_key: rank % tp,
                  "node": node, "rack": racks[node], "gpu": gpu}
                 for rank, (node, gpu) in enumerate(zip(node_of_rank, gpu_of_rank)))


def place(mesh: MeshShape, topology: Topology, excluded: frozenset[str] = frozenset()) -> Placement:
    done = topology.placed.get((mesh, excluded))
    if done is None:
        done = topology.placed[(mesh, excluded)] = _place(mesh, topology, excluded)
    return done


def _place(mesh: MeshShape, topology: Topology, excluded: frozenset[str]) -> Placement:
    nodes = topology.usable_columns(excluded)
    if (nodes.num_gpus < mesh.tp).any():
        small = nodes.name[nodes.num_gpus < mesh.tp].tolist()
        raise PlacementError(f"tp = {mesh.tp} does not fit in nodes {small[:3]} with fewer GPUs")
    # TP slots (tp consecutive GPUs of a node), node after node in rack order: columns over the slots,
    # computed whole (a 131,072-GPU cluster has 16,384 nodes, and every recovery places it again).
    per_node = nodes.num_gpus // mesh.tp
    node_of_slot = np.repeat(np.arange(len(per_node)), per_node)
    slot = np.arange(len(node_of_slot))
    gpu_of_slot = (slot - (np.cumsum(per_node) - per_node)[node_of_slot]) * mesh.tp
    # Whole pipelines inside one rack first; stages that do not fill a rack's last pipeline are pooled.
    rack_of_slot = nodes.rack_id[node_of_slot]
    slots_in_rack = np.bincount(rack_of_slot, minlength=int(nodes.rack_id[-1]) + 1 if len(per_node) else 0)
    first_in_rack = np.cumsum(slots_in_rack) - slots_in_rack
    whole = slot - first_in_rack[rack_of_slot] < (slots_in_rack // mesh.pp * mesh.pp)[rack_of_slot]
    leftovers = np.flatnonzero(~whole)
    order = np.concatenate([np.flatnonzero(whole), leftovers[: len(leftovers) // mesh.pp * mesh.pp]])
    if len(order) // mesh.pp < mesh.dp:
        offered = int(nodes.num_gpus.sum())
        raise PlacementError(
            f"mesh dp{mesh.dp} pp{mesh.pp} tp{mesh.tp} needs {mesh.world_size} GPUs in {mesh.dp} pipelines "
            f"of {mesh.pp} TP groups of {mesh.tp}; the {len(per_node)} usable nodes ({offered} GPUs) hold "
            f"{len(order) // mesh.pp} such pipelines")
    chosen = order[: mesh.dp * mesh.pp]  # the slots of pipelines 0..dp-1, stage after stage
    node_of_rank = np.repeat(nodes.name[node_of_slot[chosen]], mesh.tp)
    first_gpu = gpu_of_slot[chosen]
    if not first_gpu.any():  # every TP group starts at GPU 0 (tp = GPUs per node): the same tp GPUs repeated
        gpu_of_rank: tuple[int, ...] = tuple(range(mesh.tp)) * len(chosen)
    else:
        gpu_of_rank = tuple((np.repeat(first_gpu, mesh.tp) + np.tile(np.arange(mesh.tp), len(chosen))).tolist())
    used = np.flatnonzero(np.bincount(node_of_slot[chosen], minlength=len(per_node)))
    spares = topology.names_in(NodeState.SPARE) - excluded
    return Placement(
        mesh=mesh,
        node_of_rank=tuple(node_of_rank.tolist()),
        gpu_of_rank=gpu_of_rank,
        rack_of_node=dict(zip(nodes.name[used].tolist(), nodes.rack[used].tolist())),
        spares=tuple(n.name for n in topology.spares() if n.name in spares) if spares else (),
    )


def reseat(placement: Placement, topology: Topology, lost: Iterable[str],
           candidates: Iterable[str] | None = None) -> Placement | None:
    """`placement` with each lost node's ranks moved to a healthy node it does not use yet (one of the
    lost node's rack first, then in node order), every other rank where it was: the surviving nodes
    keep their ranks, their warm processes and the peer snapshots in their memory, and a hot spare
    takes exactly the place of the node it replaces. `candidates` limits the replacements (the spares
    just promoted); by default any healthy node the placement does not use. None when a surviving
    node is no longer healthy or a lost node has no replacement with the GPUs its ranks used."""
    healthy = topology.names_in(NodeState.HEALTHY)
    used = placement.nodes()
    gone = topology.in_node_order(set(lost) & used)
    if not gone or not (used - set(gone)) <= healthy:
        return None
    free = topology.in_node_order((healthy if candidates is None else set(candidates) & healthy) - used)
    swaps: dict[str, str] = {}
    for old in gone:
        needs = max(placement.gpu_of_rank[r] for r in placement.ranks_on(old)) + 1
        rack = placement.rack_of_node[old]
        new = first_fit = None  # the first fitting node of the lost node's rack, else the first fitting node
        for name in free:
            node = topology.node(name)
            if node.num_gpus >= needs:
                if node.rack == rack:
                    new = name
                    break
                first_fit = first_fit or name
        new = new or first_fit
        if new is None:
            return None
        free.remove(new)
        swaps[old] = new
    # the spares now, as a fresh placement lists them (the warm pool keeps actors on them)
    return swap_nodes(placement, swaps, topology, spares=tuple(n.name for n in topology.spares()))


def swap_nodes(placement: Placement, swaps: dict[str, str], topology: Topology, *,
               spares: tuple[str, ...] | None = None) -> Placement:
    """`placement` with the ranks of each node in `swaps` moved to its replacement (same GPUs), every
    other rank where it was: a replica formed again on a spare leaves the live replicas in place.
    `spares`: the new placement's (default: the old one's less those taken). Touches only the swapped
    nodes' ranks (131,072 ranks: a search per node, not a pass)."""
    before = rank_index(placement.node_of_rank)
    changes: dict[str, list[int]] = {old: [] for old in swaps}
    node_of_rank = list(placement.node_of_rank)
    for old, new in swaps.items():  # every move read from the placement before any (a swap may exchange two nodes)
        moved = before.get(old)
        for rank in moved:
            node_of_rank[rank] = new
        changes[new] = sorted(changes.get(new, before.get(new)) + moved)  # a node moved away keeps none
    moved_ranks = tuple(node_of_rank)
    _remember(moved_ranks, before.with_changes(moved_ranks, changes))
    rack_of_node = dict(placement.rack_of_node)
    for old in swaps:  # (all the old ones first: in a chain or an exchange a node is both)
        rack_of_node.pop(old, None)
    for new in swaps.values():
        rack_of_node[new] = topology.node(new).rack
    taken = set(swaps.values())
    out = Placement(mesh=placement.mesh, node_of_rank=moved_ranks, gpu_of_rank=placement.gpu_of_rank,
                    rack_of_node=rack_of_node,
                    spares=spares if spares is not None else tuple(s for s in placement.spares if s not in taken))
    # Where the swaps rename nodes one to one (no node takes the ranks of two), every rank keeps its
    # node's index and every buddy pair stays on two nodes.
    if len(set(swaps.values())) == len(swaps) and not any(before.get(new) and new not in swaps
                                                          for new in swaps.values()):
        moved = [r for old in swaps for r in before.get(old)]
        if "node_codes" in placement.__dict__:
            used, codes = placement.node_codes
            renamed = list(used)
            for old, new in swaps.items():
                renamed[codes[before.get(old)[0]]] = new
            out.__dict__["node_codes"] = (renamed, codes)
        if "_group_columns" in placement.__dict__:  # the racks of the TP groups that moved, the others' kept
            columns = placement._group_columns
            racks = list(columns["rack"])
            for group in {r // columns["tp"] for r in moved}:
                racks[group] = rack_of_node[moved_ranks[group * columns["tp"]]]
            out.__dict__["_group_columns"] = {**columns, "node": moved_ranks[::columns["tp"]], "rack": tuple(racks)}
        _carry_buddies(placement, out, moved)
    return out


def _carry_buddies(before: Placement, after: Placement, moved: list[int]) -> None:
    """`after` (`before` with nodes renamed one to one, `moved` the ranks that changed node) keeps the
    buddies `before` computed, unless the pairs they touch would share a rack more often than before:
    each survivor keeps the partner it had (its copies, and the copies it keeps, stay where they
    are), and no 16,384-node pass is redone for a spare taking one node's place."""
    mask = np.zeros(len(before.node_of_rank), dtype=bool)
    mask[moved] = True
    for replicas in list(before._buddies):
        keepers = before.peer_keepers(replicas=replicas)
        if keepers is None:
            continue
        touched = np.flatnonzero(mask | mask[keepers])
        pairs = list(zip(touched.tolist(), keepers[touched].tolist()))

        def same_rack(p: Placement) -> int:
            rack, node = p.rack_of_node, p.node_of_rank
            return sum(rack[node[r]] == rack[node[k]] for r, k in pairs)

        if same_rack(after) <= same_rack(before):
            after._buddies[replicas] = before._buddies[replicas]
            after._keepers[replicas] = keepers
