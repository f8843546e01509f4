"""Membership epochs: who trains, as the controller publishes it (the one authority on who is in), and
the board of the run's store where it does. trainer/protocol.py decides what each epoch holds,
trainer/replica.py what it means to a rank."""

from __future__ import annotations

import time

import torch.distributed as dist

from trainer.protocol import Membership

MEMBERSHIP_KEY = "membership"


class MembershipBoard:
    """Where the controller publishes membership epochs (every one it ever published, by number, and
    the newest number) and ranks read them: keys of the run's rendezvous store."""

    def __init__(self, store: dist.Store, prefix: str = MEMBERSHIP_KEY) -> None:
        self.store = store
        self.prefix = prefix

    def publish(self, membership: Membership) -> None:
        newest = self.newest_epoch()
        if membership.epoch <= newest:
            raise ValueError(f"membership epoch {membership.epoch} is not newer than the published {newest}")
        self.store.set(f"{self.prefix}/{membership.epoch}", membership.to_json())
        self.store.set(f"{self.prefix}/newest", str(membership.epoch))

    def newest_epoch(self) -> int:
        key = f"{self.prefix}/newest"
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def get(self, epoch: int) -> Membership:
        return Membership.from_json(self.store.get(f"{self.prefix}/{epoch}"))

    def due(self, after: int, next_step: int) -> int:
        """The newest epoch after `after` whose `at_step` has come by `next_step` (else `after`)."""
        newest = self.newest_epoch()
        for epoch in range(newest, after, -1):
            if self.get(epoch).at_step <= next_step:
                return epoch
        return after

    def wait_joining(self, replica: int, timeout_s: float, poll_s: float = 0.05) -> Membership:
        """The newest membership that forms `replica` again (it receives its state there)."""
        deadline = time.monotonic() + timeout_s
        seen = -1
        while True:
            newest = self.newest_epoch()
            if newest > seen:
                m = self.get(newest)
                if replica in m.joining:
                    return m
                seen = newest
            if time.monotonic() > deadline:
                raise TimeoutError(f"no membership epoch formed replica {replica} again within {timeout_s:.0f} s")
            time.sleep(poll_s)

    def wait_newer(self, epoch: int, timeout_s: float, poll_s: float = 0.05) -> Membership:
        """The newest membership after `epoch`, once the controller has published one."""
        deadline = time.monotonic() + timeout_s
        while (newest := self.newest_epoch()) <= epoch:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no membership epoch after {epoch} within {timeout_s:.0f} s")
            time.sleep(poll_s)
        return self.get(newest)
