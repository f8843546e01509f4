"""A survivor gives a cross-replica collective up the moment the controller publishes a membership
without its silent peer (trainer/abandon.py), not when the collective's timeout expires: the peer
here neither answers nor closes anything (it waits, its sockets open, as a host cut off does). A
newer epoch that only adds a joining replica is not a reason to give up."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import Ranks
from trainer.abandon import Abandoned
from trainer.replica import CrossReplica, Membership, MembershipBoard

pytestmark = pytest.mark.dist

TIMEOUT_S = 60.0
"""The group's collective timeout: far longer than the test, so only the controller's word can end the wait."""


def member(rank: int, world_size: int, store_port: int) -> dict[str, Any]:
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    board = MembershipBoard(store)
    cross = CrossReplica(store, replica=rank, position=0, device=torch.device("cpu"), timeout_s=TIMEOUT_S, board=board)
    cross.configure(board.get(0))
    buf = torch.ones(4, dtype=torch.float64)
    cross._all_reduce(buf, dist.ReduceOp.SUM)  # both take part: the group works
    assert buf.tolist() == [2.0] * 4
    store.set(f"formed/{rank}", "1")
    if rank == 1:  # the silent peer: alive, its sockets open, never in the next collective
        store.wait(["done/0"], __import__("datetime").timedelta(seconds=120))
        return {}
    started = time.time()
    try:
        cross._all_reduce(torch.ones(4, dtype=torch.float64), dist.ReduceOp.SUM)
        return {"abandoned": False}
    except Abandoned as e:
        return {"abandoned": True, "at": time.time(), "waited_s": time.time() - started, "why": str(e),
                "held": len(cross.graveyard), "group": cross.group}
    finally:
        store.set("done/0", "1")


def test_a_survivor_gives_up_a_collective_when_the_controller_leaves_its_silent_peer_out() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    board = MembershipBoard(store)
    board.publish(Membership(0, (0, 1)))
    ranks = Ranks(member, 2, port=store.port)
    store.wait(["formed/0", "formed/1"])
    time.sleep(1.0)  # the survivor waits in its collective
    board.publish(Membership(1, (0, 1, 2), joining=(2,)))  # a replica joins: nothing to give up
    time.sleep(1.0)
    published = time.time()
    board.publish(Membership(2, (0,)))  # the controller's word: replica 1 is out
    survivor, _ = ranks.collect(timeout_s=120)
    assert survivor["abandoned"], survivor
    assert "membership epoch 2 leaves out replica(s) [1]" in survivor["why"], survivor
    assert survivor["waited_s"] >= 2.0, "the joining epoch did not end the wait"
    given_up_in = survivor["at"] - published
    print(f"\ncollective given up {given_up_in:.3f} s after the epoch without its peer was published "
          f"(collective timeout {TIMEOUT_S:.0f} s)")
    assert given_up_in < TIMEOUT_S / 4, given_up_in
    assert survivor["held"] == 1 and survivor["group"] is None, "the group is held until its collective ends, not used"
