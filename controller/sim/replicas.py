"""failure_domain replica in the simulator: the part of SimWorkerGroup (controller/sim/group.py) that
answers the controller's replica calls. A lost node's replicas stop; the survivors go on after one
cross-replica init (or the `replica_stall_s` preset) at D-1 of D replicas' throughput (keeping the
batch: longer steps; shrinking it: a smaller share); replicas formed again are ready after a warm
start of their ranks and join at the first step boundary after that, the survivors stalling for the
state transfer and one more cross-replica init. Pure, as the simulator is."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from controller.attempt import AttemptSpec
from controller.events import EventKind
from controller.placement import ranks_on
from controller.sim.model import CostModel


class SimReplicas:
    """The replica half of the simulated worker group (its state lives on the group: these are the
    attributes it reads and sets)."""

    attempt: AttemptSpec | None
    clock: Callable[[], float]
    cost: CostModel
    out: set[int]
    forming: list[tuple[float, tuple[int, ...]]]
    signals: list[Any]
    next_start: float
    stop_at: float | None
    nodes: Any
    step: int
    pending_events: list[tuple[int, str, dict]]

    def _replica_domain(self) -> bool:
        a = self.attempt
        return a is not None and a.failure_domain == "replica" and a.config.mesh.dp_replicas > 1

    def _replicas_on(self, node: str) -> set[int]:
        assert self.attempt is not None
        mesh = self.attempt.config.mesh
        per = mesh.world_size // mesh.dp_replicas
        return {r // per for r in ranks_on(self.attempt.placement.node_of_rank, (node,))}

    def contains_replicas(self) -> bool:
        return self._replica_domain()

    def lose_replicas(self, replicas: list[int], nodes: tuple[str, ...], *, suspect: bool = False) -> None:
        """The controller's word: the survivors go on without `replicas` after one cross-replica init."""
        assert self.attempt is not None
        now = self.clock()
        self.out |= set(replicas)
        self.signals = [s for s in self.signals if not (s.dead_nodes & set(nodes))]
        live = self.attempt.config.mesh.dp_replicas - len(self.out)
        stall = self.cost.replica_stall_s if self.cost.replica_stall_s is not None else self.cost.regroup_s(live)
        self.next_start = max(self.next_start, now) + stall
        self.stop_at = None

    def form_replicas(self, replicas: list[int], placement: Any) -> None:
        """Form `replicas` again where `placement` puts them: ready after a warm start of their ranks."""
        assert self.attempt is not None
        self.attempt = dataclasses.replace(self.attempt, placement=placement)
        self.nodes = placement.rack_of_node
        self.forming.append((self.clock() + self.cost.replica_start_s(), tuple(replicas)))

    def _batch_share(self) -> float:
        """Of the global batch, the share a step trains now (less while replicas are out under `shrink`)."""
        a = self.attempt
        if a is None or not self.out or a.batch_while_healing == "keep":
            return 1.0
        return 1.0 - len(self.out) / a.config.mesh.dp_replicas

    def _rejoin(self, boundary: float) -> float:
        """At a step boundary: the formed replicas that are ready receive their state and join; the
        survivors' stall for it (0 when none is ready)."""
        ready = [f for f in self.forming if f[0] <= boundary]
        if not ready or self.attempt is None:
            return 0.0
        joining = sorted(r for _, replicas in ready for r in replicas)
        self.forming = [f for f in self.forming if f[0] > boundary]
        self.out -= set(joining)
        live = self.attempt.config.mesh.dp_replicas - len(self.out)
        stall = self.cost.regroup_s(live) + self.cost.replica_transfer_s
        source = min(set(range(self.attempt.config.mesh.dp_replicas)) - self.out - set(joining))
        self.pending_events.append((0, EventKind.REPLICA_REJOINED, {
            "replicas": joining, "at": boundary + stall, "step": self.step, "source": source,
            "seconds": stall}))
        return stall
