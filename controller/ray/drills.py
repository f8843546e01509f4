"""Drills on a Ray cluster: the real thing, not a simulation. The silent faults (power-off, partition,
slow-link, lossy-link, freeze-node) act on the node's own link and processes from a task placed there
(controller/ray/netfaults.py). kill-node SIGKILLs a node's raylet (on
the embedded cluster through Ray's test facility, on any other from a task on that node), kill-rank
SIGKILLs a rank's training process, hang-rank SIGSTOPs it, spot-reclaim SIGTERMs every training process
of a node and kills the node `seconds` later; slow-rank, bitflip, collective-fault and
storage-outage flip the switches of the targeted GPU slots (trainer/switches.py): the
rank's own compute takes `factor` times as long, one bit of its parameters flips in place, the rank's
next named collective between replicas fails (or starts `seconds` late), the object store refuses
checkpoint writes for `seconds`."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

from controller.drills import (DEFAULT_DELAY_MS, DEFAULT_FACTOR, DEFAULT_GRACE_S, DEFAULT_LOSS, DEFAULT_OUTAGE_S,
                               DEFAULT_POINT, DrillKind)
from controller.errors import ClusterError
from controller.ray.cluster import LocalRayCluster, RemoteRayCluster
from controller.ray.worker_group import RayWorkerGroup


class RayDrillInjector:
    """Every drill verb on a Ray cluster: a node's raylet through the cluster, a rank through its actor."""

    arms_ahead = frozenset({DrillKind.COLLECTIVE_FAULT})
    """Kinds a rank holds until their step (`from_step`): a collective fault fails the step after its
    `at_step` exactly, however late the controller hears of that step (run_drills.py)."""

    def __init__(self, cluster: LocalRayCluster | RemoteRayCluster, group: RayWorkerGroup) -> None:
        self.cluster = cluster
        self.group = group

    def inject(self, kind: DrillKind, target: str, *, factor: float | None = None, seconds: float | None = None,
               delay_ms: float | None = None, loss: float | None = None, point: str | None = None,
               from_step: int | None = None) -> dict[str, Any]:
        if kind.silent:
            delay_ms = (delay_ms or DEFAULT_DELAY_MS) if kind is DrillKind.SLOW_LINK else None
            loss = (loss or DEFAULT_LOSS) if kind is DrillKind.LOSSY_LINK else None
            return {"node": target, **silent_fault(kind, target, seconds=seconds, delay_ms=delay_ms, loss=loss)}
        if kind is DrillKind.KILL_NODE:
            self.cluster.kill_node(target)
            return {"node": target}
        if kind is DrillKind.SPOT_RECLAIM:  # the notice to every training process of the node, the end later
            grace = seconds or DEFAULT_GRACE_S
            ranks = self.group.ranks_on(target)
            pids = [self._signal(rank, signal.SIGTERM) for rank in ranks]
            ending = threading.Timer(grace, self._reclaim, args=(target,))
            ending.daemon = True
            ending.start()
            return {"node": target, "ranks": ranks, "pids": pids, "seconds": grace, "ends_at": time.time() + grace}
        if kind is DrillKind.KILL_RANK:
            return {"rank": int(target), "pid": self._signal(int(target), signal.SIGKILL)}
        if kind is DrillKind.HANG_RANK:  # the attempt's end kills the stopped process
            return {"rank": int(target), "pid": self._signal(int(target), signal.SIGSTOP)}
        if kind is DrillKind.SLOW_RANK:
            factor = factor or DEFAULT_FACTOR
            self._call(self.group.rank_actor(int(target)).slow.remote(factor))
            return {"rank": int(target), "factor": factor}
        if kind is DrillKind.BITFLIP:  # a high exponent bit of one parameter element, in place
            self._call(self.group.rank_actor(int(target)).bitflip.remote())
            return {"rank": int(target)}
        if kind is DrillKind.COLLECTIVE_FAULT:  # armed by the rank at its next step (trainer/train.py)
            point = point or DEFAULT_POINT
            self._call(self.group.rank_actor(int(target)).collective_fault.remote(point, seconds, from_step))
            return {"rank": int(target), "point": point, **({"seconds": seconds} if seconds else {})}
        if kind is DrillKind.STORAGE_OUTAGE:  # every slot's checkpoint writes are refused until then
            seconds = seconds or DEFAULT_OUTAGE_S
            until = time.time() + seconds
            self._call([actor.outage.remote(until) for actor in self.group.slot_actors()])
            return {"seconds": seconds, "until": until}
        raise ClusterError(f"drill {kind!r} is unknown")

    def _reclaim(self, node: str) -> None:
        """The grace period is over: the node goes (whatever still runs there ends with it)."""
        try:
            self.cluster.kill_node(node)
        except Exception as e:  # noqa: BLE001 - a node already gone (or a cluster shut down) is the end anyway
            print(f"goodput: spot-reclaim of {node}: the node's end failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)

    def _signal(self, rank: int, sig: int) -> int:
        """Send `sig` to one rank's training process; its pid."""
        return int(self._call(self.group.rank_actor(rank).signal_rank.remote(sig)))

    @staticmethod
    def _call(refs: Any) -> Any:
        import ray

        return ray.get(refs, timeout=30)


def silent_fault(kind: DrillKind, node: str, **params: float | None) -> dict[str, Any]:
    """Make a silent fault on `node` from a task placed there (controller/ray/netfaults.py): what it
    hits; ClusterError saying why when the node cannot take it."""
    import ray

    from controller.ray import netfaults

    def on_node(**kw: Any) -> dict[str, Any]:
        return netfaults.start_helper(kind.value, ray.util.get_node_ip_address(), **kw)

    task = ray.remote(num_cpus=0, max_retries=0)(on_node).options(label_selector={"node": node})
    done = ray.get(task.remote(**params), timeout=60)
    if "refused" in done:
        raise ClusterError(f"{kind} on {node}: {done['refused']}")
    return done
