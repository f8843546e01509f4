"""The cluster as the planner sees it: nodes with GPU slots, GPU memory and labels (node, rack).

An NVLink domain is a node. Built from the spec's `cluster.local` or from a live Ray cluster's nodes
(`controller.ray.cluster` does that translation). Pure: no ray, no torch.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace


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
        return sorted(
            (n for n in self.nodes if n.state is NodeState.HEALTHY and n.name not in excluded),
            key=lambda n: (n.rack, _natural(n.name)),
        )

    def spares(self) -> list[Node]:
        return [n for n in self.nodes if n.state is NodeState.SPARE]

    def with_state(self, name: str, state: NodeState) -> "Topology":
        return Topology(tuple(replace(n, state=state) if n.name == name else n for n in self.nodes))

    def with_racks(self, racks: "dict[str, str]") -> "Topology":
        """These nodes' racks replaced (a run spec's `cluster.racks`); other nodes as they are."""
        if not racks:
            return self
        return Topology(tuple(replace(n, rack=racks[n.name]) if n.name in racks else n for n in self.nodes))

    def node(self, name: str) -> Node:
        return self._by_name[name]

    @functools.cached_property
    def names(self) -> frozenset[str]:
        return frozenset(n.name for n in self.nodes)

    def names_in(self, state: NodeState) -> frozenset[str]:
        """Names of the nodes in `state` (computed once per topology)."""
        return self._by_state.get(state, frozenset())

    @functools.cached_property
    def _by_state(self) -> dict[NodeState, frozenset[str]]:
        groups: dict[NodeState, set[str]] = {}
        for n in self.nodes:
            groups.setdefault(n.state, set()).add(n.name)
        return {state: frozenset(names) for state, names in groups.items()}

    @functools.cached_property
    def _by_name(self) -> dict[str, Node]:
        """name -> node, built once per topology (a policy looks up every node of a 2,000-node cluster)."""
        return {n.name: n for n in self.nodes}


@functools.lru_cache(maxsize=1 << 16)
def _natural(name: str) -> tuple:
    """node-10 after node-9."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)


def merge_returned(ours: Topology, live: Topology) -> Topology:
    """Nodes we marked lost that the cluster shows alive again become healthy; nodes unknown to us
    are ignored (a later issue may adopt them)."""
    back = ours.names_in(NodeState.LOST) & live.names
    if not back:
        return ours
    return Topology(tuple(replace(n, state=NodeState.HEALTHY) if n.name in back else n for n in ours.nodes))
