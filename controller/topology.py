"""The cluster as the planner sees it: nodes with GPU slots, GPU memory and labels (node, rack).

An NVLink domain is a node. Built from the spec's `cluster.local` or from a live Ray cluster's nodes
(`controller.ray.cluster` does that translation). Pure: no ray, no torch.
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
from dataclasses import dataclass, replace
from typing import Any, Iterable, Protocol

import numpy as np


class NodeState(str, enum.Enum):
    HEALTHY = "healthy"
    SPARE = "spare"
    QUARANTINED = "quarantined"
    LOST = "lost"


@dataclass(frozen=True, kw_only=True)
class Node:
    name: str
    """Value of the node's `node` label; unique in the cluster."""
    rack: str
    """Value of the node's `rack` label."""
    num_gpus: int
    """GPU slots on the node (one NVLink domain)."""
    gpu_memory_bytes: int
    """Memory of one GPU."""
    state: NodeState = NodeState.HEALTHY
    """Whether ranks may be placed here."""
    ray_node_id: str | None = None
    """Ray's id for the node, when it runs on Ray."""


def local_roles(nodes: int, spares: int) -> dict[str, NodeState]:
    """The one spares rule of a local (embedded) cluster: nodes node-0..N-1, the last `spares` of
    them held back as spares, the others healthy."""
    return {f"node-{i}": NodeState.SPARE if i >= nodes - spares else NodeState.HEALTHY for i in range(nodes)}


@dataclass(frozen=True)
class NodeColumns:
    """Nodes as numpy columns, in rack then name order (`Topology.usable_columns`)."""
    name: np.ndarray
    rack: np.ndarray
    rack_id: np.ndarray
    """Racks numbered in order: equal for nodes of one rack, growing with the rack."""
    num_gpus: np.ndarray
    place_of: np.ndarray
    """(of the whole topology) a node's position in `nodes` -> its position in this order."""

    def take(self, rows: np.ndarray) -> "NodeColumns":
        return NodeColumns(name=self.name[rows], rack=self.rack[rows], rack_id=self.rack_id[rows],
                           num_gpus=self.num_gpus[rows], place_of=self.place_of)


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]

    @staticmethod
    def from_local(*, nodes: int, gpus_per_node: int, racks: int, spares: int,
                   gpu_memory_gb: float = 80.0) -> "Topology":
        """Nodes node-0..N-1 dealt round-robin over racks; the last `spares` nodes are held back."""
        if spares >= nodes:
            raise ValueError(f"cluster.local.spares = {spares} leaves no node to train on (nodes = {nodes})")
        if racks > nodes:
            raise ValueError(f"cluster.local.racks = {racks} is more than nodes = {nodes}")
        return Topology(tuple(
            Node(
                name=name,
                rack=f"rack-{i % racks}",
                num_gpus=gpus_per_node,
                gpu_memory_bytes=int(gpu_memory_gb * 2**30),
                state=state,
            )
            for i, (name, state) in enumerate(local_roles(nodes, spares).items())
        ))

    def usable(self, excluded: frozenset[str] = frozenset()) -> list[Node]:
        """Healthy nodes not excluded, in rack then name order (deterministic)."""
        nodes, healthy = self.nodes, NodeState.HEALTHY
        return [n for i in self._order if (n := nodes[i]).state is healthy and n.name not in excluded]

    def spares(self) -> list[Node]:
        return [self.node(name) for name in self.in_node_order(self.names_in(NodeState.SPARE))]

    def with_state(self, name: str, state: NodeState) -> "Topology":
        return self.with_states({name: state})

    def with_states(self, states: "dict[str, NodeState]") -> "Topology":
        """These nodes in these states, the others as they are. What a topology computes once (name
        order, index, columns, nodes by state) is computed on this one and carried over, changed where
        the states changed: a policy derives several topologies per failure from one of 16,384 nodes.
        Names not in the topology are ignored (as they always were)."""
        states = {name: state for name, state in states.items() if name in self._index}
        if not states:
            return self
        nodes = list(self.nodes)
        for name, state in states.items():
            i = self._index[name]
            nodes[i] = replace(nodes[i], state=state)
        out = Topology(tuple(nodes))
        for kept in ("_order", "_index", "names", "_columns", "smallest_gpu_bytes"):
            out.__dict__[kept] = getattr(self, kept)  # computed here once, then carried down the line
        healthy = self._healthy.copy()
        for name, state in states.items():
            healthy[self._columns.place_of[self._index[name]]] = state is NodeState.HEALTHY
        out.__dict__["_healthy"] = healthy
        by_state = dict(self._by_state)  # the small sets (not healthy): copied where they change
        for state in ({self.node(name).state for name in states} | set(states.values())) - {NodeState.HEALTHY}:
            leaving = {name for name, new in states.items() if new is not state}
            coming = {name for name, new in states.items() if new is state}
            by_state[state] = (by_state.get(state, frozenset()) - leaving) | coming
        out.__dict__["_by_state"] = by_state
        if "_healthy_names" in self.__dict__:  # (16,384 names: changed where the states changed)
            now_healthy = {name for name, state in states.items() if state is NodeState.HEALTHY}
            out.__dict__["_healthy_names"] = (self._healthy_names - (states.keys() - now_healthy)) | now_healthy
        return out

    def without(self, names: "frozenset[str]") -> "Topology":
        """These nodes gone (a cluster's view while they are under repair)."""
        if not names:
            return self
        cut = sorted(self._index[n] for n in names if n in self._index)
        kept = [self.nodes[a + 1:b] for a, b in zip([-1] + cut, cut + [len(self.nodes)])]
        out = Topology(tuple(itertools.chain.from_iterable(kept)))
        if "names" in self.__dict__:
            out.__dict__["names"] = self.names - names
        return out

    def with_racks(self, racks: "dict[str, str]") -> "Topology":
        """These nodes' racks replaced (a run spec's `cluster.racks`); other nodes as they are."""
        if not racks:
            return self
        return Topology(tuple(replace(n, rack=racks[n.name]) if n.name in racks else n for n in self.nodes))

    def node(self, name: str) -> Node:
        return self.nodes[self._index[name]]

    def __contains__(self, name: object) -> bool:
        """Whether a node of this name is in the topology (an index carried over by with_states)."""
        return name in self._index

    def in_node_order(self, names: "Iterable[str]") -> list[str]:
        """These nodes' names in the order of `nodes`."""
        return sorted(names, key=self._index.__getitem__)

    @functools.cached_property
    def placed(self) -> "dict[Any, Any]":
        """Placements made on this topology, by (mesh, excluded nodes): a topology is immutable, so the
        same mesh places the same way (a restart on unchanged nodes places its mesh again)."""
        return {}

    @functools.cached_property
    def smallest_gpu_bytes(self) -> int:
        """The smallest GPU memory of any node, whatever its state (0 without nodes)."""
        return min((n.gpu_memory_bytes for n in self.nodes), default=0)

    @functools.cached_property
    def names(self) -> frozenset[str]:
        return frozenset(n.name for n in self.nodes)

    def names_in(self, state: NodeState) -> frozenset[str]:
        """Names of the nodes in `state` (computed once per topology)."""
        if state is NodeState.HEALTHY:
            return self._healthy_names
        return self._by_state.get(state, frozenset())

    @functools.cached_property
    def _by_state(self) -> dict[NodeState, frozenset[str]]:
        """The nodes in each state but healthy (few: a derived topology copies them where they change)."""
        groups: dict[NodeState, set[str]] = {}
        for n in self.nodes:
            if n.state is not NodeState.HEALTHY:
                groups.setdefault(n.state, set()).add(n.name)
        return {state: frozenset(names) for state, names in groups.items()}

    @functools.cached_property
    def _healthy_names(self) -> frozenset[str]:
        """The healthy nodes (most of them: built from the columns only when asked)."""
        return frozenset(self._columns.name[self._healthy].tolist())

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        """name -> position in `nodes`, built once per topology and carried to those derived from it."""
        return dict(zip(map(operator.attrgetter("name"), self.nodes), itertools.count()))  # (all in C: 16,384 nodes)

    def usable_columns(self, excluded: frozenset[str] = frozenset()) -> "NodeColumns":
        """`usable(excluded)` as columns (numpy arrays, same order): what placement computes on."""
        keep = self._healthy
        if excluded:
            keep = keep.copy()
            for name in excluded & self.names:
                keep[self._columns.place_of[self._index[name]]] = False
        return self._columns.take(np.flatnonzero(keep))

    @functools.cached_property
    def _columns(self) -> "NodeColumns":
        ordered = [self.nodes[i] for i in self._order]
        racks = [n.rack for n in ordered]
        place_of = np.empty(len(ordered), dtype=np.int64)
        place_of[list(self._order)] = np.arange(len(ordered))
        return NodeColumns(name=np.array([n.name for n in ordered], dtype=object),
                           rack=np.array(racks, dtype=object),
                           rack_id=np.cumsum([0] + [a != b for a, b in zip(racks, racks[1:])],
                                             dtype=np.int64)[:len(racks)],
                           num_gpus=np.array([n.num_gpus for n in ordered], dtype=np.int64), place_of=place_of)

    @functools.cached_property
    def _healthy(self) -> np.ndarray:
        """Whether each node (in rack then name order) is healthy."""
        return np.array([self.nodes[i].state is NodeState.HEALTHY for i in self._order], dtype=bool)

    @functools.cached_property
    def _order(self) -> tuple[int, ...]:
        """Positions of the nodes in rack then name order."""
        return tuple(sorted(range(len(self.nodes)), key=lambda i: (self.nodes[i].rack, _natural(self.nodes[i].name))))


@functools.lru_cache(maxsize=1 << 16)
def _natural(name: str) -> tuple:
    """node-10 after node-9."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)


class TopologySource(Protocol):
    """What a cluster shows a run now (RunController asks it after a loss, and by the way while training)."""

    def __call__(self, within_s: float | None = None) -> Topology:
        """The nodes shown now; controller.errors.ClusterSilent when the cluster does not answer within
        `within_s` (None: the cluster's own wait)."""


def merge_returned(ours: Topology, live: Topology) -> Topology:
    """Nodes we marked lost that the cluster shows alive again become healthy; nodes unknown to us
    are ignored (a later issue may adopt them). Alive again means under another Ray node id where
    both are known: a node lost silently (dark, cut off) is still listed by Ray, under the same id,
    until Ray's own health checks declare it dead (~30 s by default), and one back from a partition
    under that id is not trusted again by the run that lost it."""
    back = {name for name in ours.names_in(NodeState.LOST) & live.names
            if ours.node(name).ray_node_id is None or live.node(name).ray_node_id is None
            or ours.node(name).ray_node_id != live.node(name).ray_node_id}
    if not back:
        return ours
    merged = ours.with_states({name: NodeState.HEALTHY for name in back})  # (what it computed, carried over)
    ids = {name: live.node(name).ray_node_id for name in back}
    if all(merged.node(name).ray_node_id == i for name, i in ids.items()):
        return merged
    nodes = list(merged.nodes)
    for name, i in ids.items():
        nodes[merged._index[name]] = replace(nodes[merged._index[name]], ray_node_id=i)
    out = Topology(tuple(nodes))
    out.__dict__.update({k: v for k, v in merged.__dict__.items() if k not in ("nodes", "placed")})  # (no id in them)
    return out
