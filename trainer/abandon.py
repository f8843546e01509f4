"""Collectives across replicas that a survivor can give up at the controller's word.

When a peer replica's host goes dark nothing closes its sockets: a survivor's all-reduce would wait
for its collective timeout (gloo: the group's timeout; NCCL: the watchdog's, whose default error
handling then tears the survivor's process down). The controller, which detects the loss from the
node's heartbeat in about a second (health/heartbeat.py), publishes a membership epoch without the
lost replica; a survivor waiting in a collective watches for it (`wait`) and gives the collective up
at once (`Abandoned`): the step is discarded and trained again under the new epoch.

What giving up leaves behind, and how it is kept harmless:
- gloo cannot abort a collective (`abort()` does nothing there) and a group's destructor joins its
  worker threads, which wait out the collective: a dropped group goes to a `Graveyard`, which holds
  it until its collectives end, and the survivor goes on with a new group at once;
- the abandoned collective's buffers are its own (a copy of the gradients; `sync` receives into
  staging copies), so a peer that comes back from a partition can write nothing into live state;
- NCCL: communicators are built non-blocking and connected eagerly, their errors handled without
  tearing the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set for these groups only), and
  `abort()` ends a given-up group's communicators at once (as torchft does; see the README's
  "Silent faults" for what a single GPU can and cannot check of this).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

WATCH_S = 0.05
"""How often a waiting collective asks whether it is to be given up (after its first WATCH_S)."""


class Abandoned(RuntimeError):
    """A collective given up: the controller published a membership that leaves out one of its peers."""


class Graveyard:
    """Groups given up with collectives in flight, held until those end (a gloo group dropped before
    that blocks its dropper until the collective times out)."""

    def __init__(self) -> None:
        self._held: list[tuple[Any, list[Any]]] = []

    def hold(self, group: Any, works: list[Any]) -> None:
        self._held.append((group, works))
        self.prune()

    def prune(self) -> None:
        self._held = [(g, ws) for g, ws in self._held if not all(_done(w) for w in ws)]

    def __len__(self) -> int:
        return len(self._held)


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that cannot say is as good as ended
        return True


def build(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
          give_up: Callable[[], str | None] | None = None) -> Any:
    """A backend of `size` ranks on `store` (a fresh prefix per epoch and position). Every rank says
    it has arrived first and the backend is built once all have: until then `give_up()` is asked
    every WATCH_S (Abandoned: a member that will never come, or a newer epoch to form instead; the
    backend's own rendezvous could only time out)."""
    if give_up is not None:
        _meet(store, rank, size, give_up, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    # A non-blocking communicator's own operations (its init, its abort) wait this long at most, not
    # NCCL's default 30 minutes (torchft sets it the same way).
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(timeout_s)))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.config.blocking = 0  # non-blocking communicators: an abort never waits behind a hung init
    saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # (read by the constructor) clean up, never tear down
    try:
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
    finally:
        if saved is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    group.eager_connect_single_device(device)  # the communicator now, not inside the first collective
    return group


def _meet(store: dist.Store, rank: int, size: int, give_up: Callable[[], str | None], timeout_s: float) -> None:
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        why = give_up()
        if why is not None:
            raise Abandoned(why)
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([f"arrived/{r}"])]
            raise TimeoutError(f"cross-replica group: member(s) {missing} did not arrive in {timeout_s:.0f} s")
        time.sleep(WATCH_S)


def wait(work: Any, *, give_up: Callable[[], str | None], timeout_s: float) -> None:
    """`work.wait()`, unless `give_up()` says why first (asked every WATCH_S once the collective has
    taken that long): then Abandoned. A collective that outlives `timeout_s` raises TimeoutError."""
    start = time.monotonic()
    asked = start
    pause = 0.0002
    while not work.is_completed():
        now = time.monotonic()
        if now - asked >= WATCH_S:
            asked = now
            why = give_up()
            if why is not None:
                raise Abandoned(why)
        if now - start > timeout_s:
            raise TimeoutError(f"a cross-replica collective did not end in {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    work.wait()  # (ended: returns at once, or raises the collective's error)


def errored(group: Any) -> str | None:
    """Why `group`'s communicators failed, or None. NCCL: a collective's work may say completed when
    it failed or was aborted (its output then is not a sum of anything), and the error shows on the
    group (`get_error`) once the device has caught up: synchronized first, as torchft's errored()
    does, so that nothing it produced is voted on. gloo: a failed collective raises in its wait."""
    get_error = getattr(group, "get_error", None)
    if get_error is None:
        return None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    error = get_error()
    return None if getattr(error, "name", str(error)) == "SUCCESS" else f"the communicator failed: {error}"


def abort(group: Any, works: list[Any], graveyard: Graveyard) -> None:
    """Give `group` up: its communicators ended where the backend can (NCCL), and the group held
    until its collectives end (gloo)."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - a broken group may refuse even that; it is given up either way
        pass
    graveyard.hold(group, [w for w in works if not _done(w)])
