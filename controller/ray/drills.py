"""Drills on a Ray cluster: the real thing, not a simulation. kill-node SIGKILLs a node's raylet (on
the embedded cluster through Ray's test facility, on any other from a task on that node), kill-rank
SIGKILLs a rank's training process, hang-rank SIGSTOPs it; slow-rank, bitflip and storage-outage
flip the switches of the targeted GPU slots (trainer/switches.py): the
rank's own compute takes `factor` times as long, one bit of its parameters flips in place, the
object store refuses checkpoint writes for `seconds`."""

from __future__ import annotations

from typing import Any

from controller.drills import DEFAULT_FACTOR, DEFAULT_OUTAGE_S, DrillKind
from controller.ray.cluster import ClusterError, LocalRayCluster, RemoteRayCluster
from controller.ray.workers import RayWorkerGroup


class RayDrillInjector:
    def __init__(self, cluster: LocalRayCluster | RemoteRayCluster, group: RayWorkerGroup) -> None:
        self.cluster = cluster
        self.group = group

    def inject(self, kind: DrillKind, target: str, *, factor: float | None = None,
               seconds: float | None = None) -> dict[str, Any]:
        if kind is DrillKind.KILL_NODE:
            self.cluster.kill_node(target)
            return {"node": target}
        if kind is DrillKind.KILL_RANK:
            return {"rank": int(target), "pid": self.group.kill_rank(int(target))}
        if kind is DrillKind.HANG_RANK:
            return {"rank": int(target), "pid": self.group.stop_rank(int(target))}
        if kind is DrillKind.SLOW_RANK:
            factor = factor or DEFAULT_FACTOR
            self.group.slow_rank(int(target), factor)
            return {"rank": int(target), "factor": factor}
        if kind is DrillKind.BITFLIP:
            self.group.bitflip_rank(int(target))
            return {"rank": int(target)}
        if kind is DrillKind.STORAGE_OUTAGE:
            seconds = seconds or DEFAULT_OUTAGE_S
            until = self.group.storage_outage(seconds)
            return {"seconds": seconds, "until": until}
        raise ClusterError(f"drill {kind!r} is unknown")
