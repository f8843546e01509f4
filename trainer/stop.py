"""A stop at a step boundary, asked from outside the ranks: a preemption (a higher-priority run needs the
GPUs) or a drain (a node must go). The controller sets `stop` under the attempt's prefix in the run's
rendezvous store, saying how the state is to be kept; at every step boundary rank 0 looks, and the world
agrees in one all-reduce of a small code, so every rank stops after the same step with nothing in flight.

How the state is kept:
- `store`: a durable checkpoint of that step (the run resumes anywhere, later: a preemption; its nodes
  go to another run, and with them the peer snapshots in their memory);
- `peers`: the peer snapshot of that step (the run resumes at once with one node's ranks moved: a
  drain, where every rank's state outlives the one node; 0 bytes read from the store). Between two
  snapshot steps the ranks train on to the next; a run without peer snapshots keeps it in the store.
A run with neither never stops this way (nothing would keep its state).

A SIGTERM on a rank's process (a spot VM reclaimed, a Kubernetes eviction: a grace period, then the
end) is a stop too: the rank catches it, the world agrees on it at the next boundary like a drain
(`peers`), and the rank says `terminating` so that the controller reseats its node's ranks elsewhere.
"""

from __future__ import annotations

import enum
import json
import signal
import threading
import time
from typing import Any

STOP_KEY = "stop"


class Keep(enum.IntEnum):
    NONE = 0
    PEERS = 1
    STORE = 2


def request_stop(store: Any, keep: Keep, reason: str) -> None:
    """Ask the ranks of the attempt whose prefixed store this is to stop at their next step boundary."""
    store.set(STOP_KEY, json.dumps({"keep": keep.name.lower(), "reason": reason}))


def stop_asked(store: Any) -> tuple[Keep, str]:
    """What the store asks now (Keep.NONE: nothing)."""
    if not store.check([STOP_KEY]):
        return Keep.NONE, ""
    asked = json.loads(store.get(STOP_KEY))
    return Keep[str(asked["keep"]).upper()], str(asked.get("reason", ""))


class StopWatch:
    """One per rank and attempt; `poll()` is collective (every rank, every step boundary)."""

    def __init__(self, store: Any, *, rank: int, device: Any, catch_sigterm: bool = True) -> None:
        self.store, self.rank, self.device = store, rank, device
        self.keep = Keep.NONE
        """What the world agreed on (kept once agreed: a `peers` stop may wait for its snapshot step)."""
        self.reason = ""
        self.agreed_step: int | None = None
        """The step after which the world agreed on the stop (it stops there or at its next snapshot step)."""
        self.terminated_at: float | None = None
        """When this process got a SIGTERM (time.monotonic), if it did."""
        self._caught = catch_sigterm and threading.current_thread() is threading.main_thread()  # (only there can it)
        self._previous: Any = signal.signal(signal.SIGTERM, self._on_sigterm) if self._caught else None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.terminated_at is None:  # (only a flag: the loop acts on it at its next step boundary)
            self.terminated_at = time.monotonic()

    def close(self) -> None:
        """Hand SIGTERM back to whoever had it (whoever ends the process now ends it)."""
        if self._caught:  # (None: a handler not set from Python; the default is what it did)
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._caught = False

    def poll(self, step: int) -> Keep:
        """What the world agrees on after `step` (each rank calls it at each step boundary)."""
        import torch
        import torch.distributed as dist

        if self.keep is not Keep.NONE:
            return self.keep
        mine = Keep.NONE
        if self.rank == 0:
            mine, self.reason = stop_asked(self.store)
        if self.terminated_at is not None:  # (its node goes within the grace period: leave like a drain)
            mine = max(mine, Keep.PEERS)
        agreed = torch.tensor([int(mine)], dtype=torch.int32, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.keep = Keep(int(agreed.item()))
        if self.keep is not Keep.NONE:
            self.agreed_step = step
        if self.keep is not Keep.NONE and not self.reason:  # (no request in the store: a rank's own SIGTERM)
            self.reason = "a rank's SIGTERM"
        return self.keep

    def where(self, *, step: int, peer_every: int, has_peers: bool, has_store: bool) -> Keep:
        """Whether to stop after `step` and how the state is kept there (Keep.NONE: train on). Every rank
        answers alike: the same agreed request, step and settings."""
        if self.keep is Keep.NONE:
            return Keep.NONE
        if (self.keep is Keep.PEERS or not has_store) and has_peers and peer_every > 0:
            return Keep.PEERS if step % peer_every == 0 else Keep.NONE  # (on to the next snapshot step)
        return Keep.STORE if has_store else Keep.NONE  # (nothing could keep the state: no stop)
