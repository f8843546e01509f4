"""The replica protocol's races reproduced by construction (issue 44): a fault injected at a named
protocol point on a named rank at a named step (trainer/protocol.ProtocolFault), a controller that
decides with the protocol's own Roster from what the ranks say (tests/dist/replica_races.py), and
the result compared with a float64 single process that never failed."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.dist.parity import reference_training
from tests.dist.replica_races import RosterController
from tests.dist.test_parity import assert_same_params
from tests.dist.test_replica import TOL, replica_config, whole_run

pytestmark = pytest.mark.dist


def kinds(log: list[dict], kind: str) -> list[dict]:
    return [e for e in log if e["kind"] == kind]


@pytest.mark.parametrize("faults", [("reduce@3:step=5",), ("agree@2:step=5",), ("init@1:step=1",),
                                    ("reduce@2:step=6:delay=25", "reduce@3:step=6:delay=25")],
                         ids=["reduce-fails", "agree-fails", "init-fails", "replica-late"])
def test_a_failed_collective_with_no_replica_lost_is_resolved_by_the_next_epoch(faults: tuple[str, ...]) -> None:
    """Item 1: a transient collective error (or a replica slower than the 20 s timeout) discarded the
    step, the controller found no lost node and published nothing, and the survivors waited for the
    hang verdict. Two replicas of pp2: the fault at one rank discards the step everywhere (or fails
    the epoch's forming), the controller's Roster answers the discard with a resync epoch of the same
    members, every rank forms it, and the run ends with both replicas holding the same bytes, equal
    to a float64 single process (no sample skipped or repeated)."""
    cfg = replica_config(dp_shard=1, pp=2, tp=1, steps=10)
    c = RosterController(2)
    try:
        runs = [c.start(cfg, k, faults=faults) for k in (0, 1)]
        results = [run.collect(timeout_s=240) for run in runs]
    finally:
        c.close()
    ref, _ = reference_training(whole_run(cfg, 2))
    for replica in results:
        assert_same_params([r["params"] for r in replica], ref, TOL)
    assert [r["checksum"] for r in results[0]] == [r["checksum"] for r in results[1]]
    resyncs = [m for m in c.published if m.resync]
    assert resyncs and all(m.replicas == (0, 1) for m in resyncs), c.published
    failed = [e for rs in results for r in rs for e in r["log"] if e["kind"] in ("discarded", "switch_failed")]
    assert failed, "the fault was injected and seen"
    for rs in results:
        for r in rs:
            switched = {e["epoch"] for e in kinds(r["log"], "switched")}
            assert resyncs[-1].epoch in switched, r["log"]


def test_a_corrupted_replica_found_at_an_epoch_switch_is_named_and_leaves() -> None:
    """Item 2: corruption found during `sync` was swallowed (`switch_to` waited for an epoch that never
    came), and a minority member was overwritten with no event. Three replicas; replica 2's AdamW
    state is corrupted after step 4 (no probe sees it), and a failed reduce at step 5 brings an epoch
    switch before any comparison: the switch finds replica 2 outside the majority, replica 2 says
    `sdc_suspect` (contained, its ranks named) and ends, the controller loses it, and replicas 0 and 1
    train on to the end with the same bytes."""
    base = replica_config(dp_shard=1, pp=2, tp=1, steps=8)
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=12))
    c = RosterController(3)
    try:
        runs = [c.start(cfg, k, faults=("reduce@0:step=5",), corrupt_at=4 if k == 2 else None) for k in (0, 1, 2)]
        results = [run.collect(timeout_s=240) for run in runs]
    finally:
        c.close()
    corrupted = results[2]
    assert all(r["sdc"] is not None and r["step"] == 4 for r in corrupted), [r["sdc"] for r in corrupted]
    said = [d for r in corrupted for kind, d in r["events"] if kind == "sdc_suspect"]
    assert len(said) == 1 and said[0]["contained"] and said[0]["replicas"] == [2] and said[0]["check"] == "replica_sync"
    assert said[0]["ranks"], "the ranks whose shard diverged are named"
    survivors = results[0] + results[1]
    assert all(r["sdc"] is None and r["step"] == 8 for r in survivors)
    assert [r["checksum"] for r in results[0]] == [r["checksum"] for r in results[1]]
    assert c.published[-1].replicas == (0, 1)


def test_a_donor_killed_mid_transfer_leaves_the_joiner_to_a_member_that_holds_the_same_bytes() -> None:
    """Item 4, a donor dying during the transfer at D = 3. Three replicas of one process; replica 2
    is lost after its 3rd step and formed again. When it joins, replica 0 (the first vouched member:
    the donor) holds its transfer back 15 s (a `sync` fault, under the 20 s timeout) and is SIGKILLed
    in the middle of it. Replica 2 now holds a mix no one vouches for; replica 1 received the bytes it
    already held. The next epoch, without replica 0, heals replica 2 from replica 1, and both end
    with the bytes of a float64 single process. (Every receiver counted as cut off before: no
    member held the state, and the run had to stop the world.)"""
    base = replica_config(dp_shard=1, pp=1, tp=1, steps=12)
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=12))
    c = RosterController(3)
    try:
        donor = c.start(cfg, 0, faults=("sync@0:delay=15",))
        keeper = c.start(cfg, 1)
        lost = c.start(cfg, 2)
        c.wait("replica 2's third step", lambda: c.progress(2) >= 3)
        lost.kill()
        c.lose(2)
        joiner = c.start(cfg, 2, incarnation=1)
        c.wait("the epoch that lists replica 2 joining", lambda: any(2 in m.joining for m in c.published))
        joining = next(m for m in c.published if 2 in m.joining)
        time.sleep(4.0)  # the members switch at their next step's end (well under 1 s): replica 0 is in its delay
        donor.kill()
        c.lose(0)
        kept = keeper.collect(timeout_s=240)
        healed = joiner.collect(timeout_s=240)
    finally:
        c.close()
    ref, _ = reference_training(whole_run(cfg, 3))
    for replica in (kept, healed):
        assert_same_params([r["params"] for r in replica], ref, TOL)
    assert [r["checksum"] for r in kept] == [r["checksum"] for r in healed]
    log = healed[0]["log"]
    cut = [e for e in log if e["kind"] == "switch_failed" and e.get("epoch") == joining.epoch]
    assert cut, f"replica 2's first transfer (epoch {joining.epoch}) was not cut off: {log}"
    switched = [e for e in log if e["kind"] == "switched"]
    assert switched and switched[0]["epoch"] > joining.epoch and switched[0]["source"] == 1, log
    assert c.published[-1].replicas == (1, 2), c.published
