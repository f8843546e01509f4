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

from dataclasses import dataclass
from typing import Iterator

from controller.topology import Node, Topology
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
    """Rack of every node used."""
    spares: tuple[str, ...]
    """Nodes held back for replacement."""

    def rows(self) -> Iterator[dict]:
        """{rank, dp, pp, tp, node, rack, gpu} per rank (the REST/CLI form). The same placement gives the
        same (shared, not to be edited) rows: a 16k-rank run restarted on its nodes lists them once."""
        return iter(_rows(self.mesh, self.node_of_rank, self.gpu_of_rank,
                          tuple(sorted(self.rack_of_node.items()))))

    @classmethod
    def from_rows(cls, rows: list[dict], mesh: MeshShape, spares: list[str]) -> "Placement":
        """The Placement whose `rows()` these are (as an `attempt_started` event records them)."""
        ordered = sorted(rows, key=lambda r: r["rank"])
        return cls(mesh=mesh, node_of_rank=tuple(r["node"] for r in ordered),
                   gpu_of_rank=tuple(int(r["gpu"]) for r in ordered),
                   rack_of_node={r["node"]: r["rack"] for r in ordered}, spares=tuple(spares))

    def nodes_used(self) -> list[str]:
        return sorted(set(self.node_of_rank))

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]


_last: list[tuple[MeshShape, tuple[str, ...], tuple[int, ...], dict[str, str], tuple[dict, ...]]] = []
"""The rows made last: a relaunch that replaced a node shares the other ranks' rows with them."""


@functools.lru_cache(maxsize=8)
def _rows(mesh: MeshShape, node_of_rank: tuple[str, ...], gpu_of_rank: tuple[int, ...],
          rack_items: tuple[tuple[str, str], ...]) -> tuple[dict, ...]:
    racks = dict(rack_items)
    before = _last[0] if _last and _last[0][0] == mesh and len(_last[0][1]) == len(node_of_rank) else None
    dp_key, pp_key, tp_key = mesh.rank_coords(0)  # the coordinates' names, in their order
    tp, per_replica = mesh.tp, mesh.pp * mesh.tp
    rows = []
    for rank, (node, gpu) in enumerate(zip(node_of_rank, gpu_of_rank)):
        if before is not None and before[1][rank] == node and before[2][rank] == gpu \
                and before[3].get(node) == racks[node]:
            rows.append(before[4][rank])  # the same rank on the same GPU: the same row
            continue
        rows.append({"rank": rank, dp_key: rank // per_replica, pp_key: rank % per_replica // tp, tp_key: rank % tp,
                     "node": node, "rack": racks[node], "gpu": gpu})
    out = tuple(rows)
    _last[:] = [(mesh, node_of_rank, gpu_of_rank, racks, out)]
    return out


def _tp_slots(node: Node, tp: int) -> list[tuple[str, int]]:
    """(node, first gpu) of each TP group the node can hold."""
    return [(node.name, g) for g in range(0, node.num_gpus - tp + 1, tp)]


def place(mesh: MeshShape, topology: Topology, excluded: frozenset[str] = frozenset()) -> Placement:
    nodes = topology.usable(excluded)
    if any(n.num_gpus < mesh.tp for n in nodes):
        small = [n.name for n in nodes if n.num_gpus < mesh.tp]
        raise PlacementError(f"tp = {mesh.tp} does not fit in nodes {small[:3]} with fewer GPUs")
    racks: dict[str, list[Node]] = {}
    for n in nodes:
        racks.setdefault(n.rack, []).append(n)
    # Whole pipelines inside one rack first; stages that do not fill a rack's last pipeline are pooled.
    pipelines: list[list[tuple[str, int]]] = []
    leftovers: list[tuple[str, int]] = []
    for rack in sorted(racks):
        slots = [s for n in racks[rack] for s in _tp_slots(n, mesh.tp)]
        whole = len(slots) // mesh.pp * mesh.pp
        pipelines.extend(slots[i:i + mesh.pp] for i in range(0, whole, mesh.pp))
        leftovers.extend(slots[whole:])
    pipelines.extend(leftovers[i:i + mesh.pp] for i in range(0, len(leftovers) - mesh.pp + 1, mesh.pp))
    if len(pipelines) < mesh.dp:
        offered = sum(n.num_gpus for n in nodes)
        raise PlacementError(
            f"mesh dp{mesh.dp} pp{mesh.pp} tp{mesh.tp} needs {mesh.world_size} GPUs in {mesh.dp} pipelines "
            f"of {mesh.pp} TP groups of {mesh.tp}; the {len(nodes)} usable nodes ({offered} GPUs) hold "
            f"{len(pipelines)} such pipelines")
    node_of_rank: list[str] = []
    gpu_of_rank: list[int] = []
    tp_offsets = range(mesh.tp)
    for pipeline in pipelines[: mesh.dp]:
        for node, first_gpu in pipeline:
            node_of_rank.extend([node] * mesh.tp)
            gpu_of_rank.extend(first_gpu + t for t in tp_offsets)
    used = set(node_of_rank)
    return Placement(
        mesh=mesh,
        node_of_rank=tuple(node_of_rank),
        gpu_of_rank=tuple(gpu_of_rank),
        rack_of_node={n.name: n.rack for n in nodes if n.name in used},
        spares=tuple(n.name for n in topology.spares() if n.name not in excluded),
    )
