"""Drills on a Ray cluster: the real thing, not a simulation. kill-node SIGKILLs a node's raylet
(embedded cluster), kill-rank SIGKILLs a rank's training process, hang-rank SIGSTOPs it."""

from __future__ import annotations

from typing import Any

from controller.ray_cluster import ClusterError, LocalRayCluster, RemoteRayCluster
from controller.ray_workers import RayWorkerGroup


class RayDrillInjector:
    def __init__(self, cluster: LocalRayCluster | RemoteRayCluster, group: RayWorkerGroup) -> None:
        self.cluster = cluster
        self.group = group

    def inject(self, kind: str, target: str) -> dict[str, Any]:
        if kind == "kill-node":
            self.cluster.kill_node(target)
            return {"node": target}
        if kind == "kill-rank":
            return {"rank": int(target), "pid": self.group.kill_rank(int(target))}
        if kind == "hang-rank":
            return {"rank": int(target), "pid": self.group.stop_rank(int(target))}
        raise ClusterError(f"drill {kind!r} is not available yet; use kill-node, kill-rank or hang-rank")
