"""An attempt's heartbeats, the controller's side (health/heartbeat.py says why and what the verdicts
are): the counters its rank actors add to in the run's store are read once per poll, through a
client of their own whose every call gives up within a second (a controller cut off from the store
must not wait 30 s in a poll: it finds every node silent and suspects itself), and each node's last
movement is kept by this process's clock.

A silent node is declared lost only when other evidence agrees (`corroborate`): its raylet neither
accepts nor refuses a connection within the probe's wait, or its actors have left a drain unanswered
(a frozen host whose kernel still completes the probe's handshake)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from controller.ray.liveness import raylet_addresses, unanswered
from controller.ray.rank_actor import heartbeat_key
from health.heartbeat import HEARTBEAT_TIMEOUT_S, SilenceVerdict, corroborated, silence

READ_TIMEOUT_S = 1.0
"""How long one read of the counters may take before this poll counts them as not moved."""


class HeartbeatWatch:
    """The heartbeats of one attempt's ranks (`node_of_rank`), from the store at (host, port) under
    the attempt's `prefix`."""

    def __init__(self, host: str, port: int, prefix: str, node_of_rank: tuple[str, ...], *,
                 timeout_s: float = HEARTBEAT_TIMEOUT_S, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self.node_of_rank = node_of_rank
        self.keys = [heartbeat_key(prefix, rank) for rank in range(len(node_of_rank))]
        self._at = (host, port)
        self._client: Any = self._connect()
        for key in self.keys:  # (present from the start: one multi_get reads them all, none blocks)
            self._client.add(key, 0)
        now = self.clock()
        self._values: list[int] = [-1] * len(self.keys)
        self.last_moved: dict[str, float] = {node: now for node in set(node_of_rank)}
        """node -> when any of its ranks' counters last moved (this process's clock); a node starts
        watched at the attempt's launch."""
        self.read_failed_since: float | None = None
        """When the reads of the store began to fail (None: the last one answered)."""

    def _connect(self) -> Any:
        import torch.distributed as dist

        return dist.TCPStore(*self._at, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=READ_TIMEOUT_S))

    def moved(self, node_of_rank: tuple[str, ...]) -> None:
        """Ranks moved to other nodes (a replica formed again): the new ones are watched from now."""
        now = self.clock()
        for node in set(node_of_rank) - set(self.node_of_rank):
            self.last_moved[node] = now
        for node in set(self.node_of_rank) - set(node_of_rank):
            self.last_moved.pop(node, None)
        self.node_of_rank = node_of_rank

    def verdict(self, out: set[int]) -> SilenceVerdict:
        """Read the counters (ranks in `out` are not watched: their replica is not training) and say
        which nodes are silent now."""
        now = self.clock()
        try:
            self._client = self._client or self._connect()
            values = [int(v) for v in self._client.multi_get(self.keys)]
            self.read_failed_since = None
        except Exception:  # noqa: BLE001 - the store does not answer this process: nothing moved
            values, self._client = self._values, None  # (a client that timed out is connected afresh)
            self.read_failed_since = self.read_failed_since or now
        for rank, (old, new) in enumerate(zip(self._values, values)):
            if new != old and rank not in out:
                self.last_moved[self.node_of_rank[rank]] = now
        self._values = values
        watched = {self.node_of_rank[r] for r in range(len(self.node_of_rank)) if r not in out}
        return silence(now, {n: t for n, t in self.last_moved.items() if n in watched}, timeout_s=self.timeout_s)


def corroborate(verdict: SilenceVerdict, *, unresponsive_nodes: set[str]) -> dict[str, str]:
    """The silent nodes other evidence agrees are gone, each with what was seen (the failure's message)."""
    if not verdict.silent:
        return {}
    probe = unanswered(raylet_addresses(set(verdict.silent)))
    lost = corroborated(verdict.silent, probe_unanswered=probe, drains_unanswered=unresponsive_nodes,
                        collectives_failed=set())
    return {node: f"no heartbeat for {verdict.silent_s[node]:.1f} s; "
                  + ("its raylet does not answer" if node in probe else "its actors do not answer")
            for node in sorted(lost)}
