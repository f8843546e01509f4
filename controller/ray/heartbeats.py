"""An attempt's heartbeats, the controller's side (health/heartbeat.py says why and what the verdicts
are): the counters its rank actors add to in the run's store are read once per poll, through a
client of their own whose every call gives up within a second (a controller cut off from the store
must not wait 30 s in a poll: it finds every node silent and suspects itself), and each node's last
movement is kept by this process's clock.

A silent node is declared lost only when other evidence agrees (`corroborate`): its raylet neither
accepts nor refuses a connection within the probe's wait, or its actors have left a drain unanswered
(a frozen host whose kernel still completes the probe's handshake)."""

from __future__ import annotations

import concurrent.futures
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
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="goodput-heartbeats")
        self._pending: concurrent.futures.Future | None = None
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

    def _read(self) -> list[int] | None:
        """The counters, or None when they cannot be had within READ_TIMEOUT_S. The read runs on a
        thread of its own and is waited for that long only: a store cut off from this process may
        leave a read unanswered for as long as the cut lasts, whatever the client's timeout says, and
        the poll must go on (a read still in flight is not doubled; its answer is used when it comes)."""
        if self._pending is None:
            self._pending = self._reader.submit(self._fetch)
        done = self._pending
        try:
            values = done.result(timeout=READ_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - the client failed: connected afresh at the next read
            self._client, self._pending = None, None
            return None
        self._pending = None
        return values

    def close(self) -> None:
        """Stop reading (a read still in flight ends on its own)."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _fetch(self) -> list[int]:
        self._client = self._client or self._connect()
        return [int(v) for v in self._client.multi_get(self.keys)]

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
        values = self._read()
        if values is None:  # the store does not answer this process: nothing moved
            values = self._values
            self.read_failed_since = self.read_failed_since or now
        else:
            self.read_failed_since = None
        for rank, (old, new) in enumerate(zip(self._values, values)):
            if new != old and rank not in out:
                self.last_moved[self.node_of_rank[rank]] = now
        self._values = values
        watched = {self.node_of_rank[r] for r in range(len(self.node_of_rank)) if r not in out}
        return silence(now, {n: t for n, t in self.last_moved.items() if n in watched}, timeout_s=self.timeout_s)


def isolation(verdict: SilenceVerdict | None) -> str | None:
    """Why this controller suspects itself rather than the nodes (every node silent at once), or None."""
    if verdict is None or not verdict.self_suspect:
        return None
    return (f"no heartbeat from any of the attempt's {len(verdict.silent_s)} nodes for "
            f"{min(verdict.silent_s.values()):.1f} s: this controller suspects itself (its link to the run's "
            "store, or its own process), not the nodes; it declares none of them lost")


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
