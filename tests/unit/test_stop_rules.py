"""Where a stop asked at a step boundary lands (trainer/stop.py `StopWatch.where`): every rank answers
alike from the agreed request and the run's settings, so the world stops after one step."""

from __future__ import annotations

import pytest

from trainer.stop import Keep, StopWatch, request_stop, stop_asked


class Store:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)


def watch(keep: Keep) -> StopWatch:
    w = StopWatch(Store(), rank=0, device=None)
    w.keep = keep
    return w


@pytest.mark.parametrize(("keep", "step", "peer_every", "peers", "store", "expected"), [
    (Keep.NONE, 5, 1, True, True, Keep.NONE),  # nothing asked: train on
    (Keep.STORE, 5, 1, True, True, Keep.STORE),  # a preemption: commit this step
    (Keep.PEERS, 5, 1, True, True, Keep.PEERS),  # a drain: this step's snapshot
    (Keep.PEERS, 5, 2, True, True, Keep.NONE),  # between two snapshots: on to the next
    (Keep.PEERS, 6, 2, True, True, Keep.PEERS),
    (Keep.PEERS, 5, 0, False, True, Keep.STORE),  # no snapshots: the store keeps it
    (Keep.STORE, 5, 2, True, False, Keep.NONE),  # no store: on to the snapshot step
    (Keep.STORE, 6, 2, True, False, Keep.PEERS),
    (Keep.STORE, 5, 0, False, False, Keep.NONE),  # nothing could keep the state: no stop
])
def test_where_a_stop_lands(keep: Keep, step: int, peer_every: int, peers: bool, store: bool, expected: Keep) -> None:
    assert watch(keep).where(step=step, peer_every=peer_every, has_peers=peers, has_store=store) is expected


def test_the_request_travels_through_the_store() -> None:
    store = Store()
    assert stop_asked(store) == (Keep.NONE, "")
    request_stop(store, Keep.PEERS, "drain of node-3")
    assert stop_asked(store) == (Keep.PEERS, "drain of node-3")
