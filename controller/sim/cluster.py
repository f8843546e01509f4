"""The simulated cluster (controller.sim.run drives it): a virtual clock, and the nodes of
`cluster.simulated` with those under repair missing from its topology. Pure: no ray, torch or boto3."""

from __future__ import annotations

import math
from typing import Any, Callable

from controller.topology import Topology


class VirtualClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class SimCluster:
    """The cluster's nodes (`cluster.simulated`); a node under repair is missing from its topology."""

    def __init__(self, topology: Topology, clock: Callable[[], float]) -> None:
        self.full = topology
        self.clock = clock
        self.down_until: dict[str, float] = {}
        """node -> when its repair ends (only repairs not yet over at the last look)."""
        self._down: frozenset[str] = frozenset()
        self._topology = topology
        self._settled_until = -math.inf
        """Until then no repair ends and no node went down: the last topology holds (the controller asks
        at every poll, and a 54-day run at 131,072 GPUs has thousands of nodes under repair)."""

    def topology(self, within_s: float | None = None) -> Topology:
        """The nodes not under repair now (a simulated cluster answers at once: `within_s` is not needed)."""
        now = self.clock()
        if now < self._settled_until:
            return self._topology
        self.down_until = {n: t for n, t in self.down_until.items() if t > now}
        self._settled_until = min(self.down_until.values(), default=math.inf)
        down = frozenset(self.down_until)
        if down != self._down:  # one Topology per set of nodes under repair
            self._down = down
            self._topology = self.full.without(down)
        return self._topology

    def take_down(self, node: str, until: float) -> None:
        self.down_until[node] = max(self.down_until.get(node, -math.inf), until)
        self._settled_until = -math.inf

    def next_repair(self, after: float) -> float | None:
        later = [t for t in self.down_until.values() if t > after]
        return min(later) if later else None


def spare_topology(sim: Any) -> Topology:
    """`cluster.simulated` as a Topology (the last `spares` nodes are hot spares)."""
    return Topology.from_local(nodes=sim.nodes, gpus_per_node=sim.gpus_per_node, racks=sim.racks, spares=sim.spares,
                               gpu_memory_gb=sim.gpu_memory_gb)
