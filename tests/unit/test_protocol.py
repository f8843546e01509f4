"""The replica protocol's decisions (trainer/protocol.py) under random interleavings (issue 44): a
hypothesis rule-based state machine plays the controller (a Roster) and the replicas (each a step
and a state, the state a hash chain whose true value at each step is known) through failed
collectives that split a commit, node losses, replicas formed and ready, donors dying mid-transfer,
at-rest corruption and controller restarts, and checks after every epoch switch:
- every member holds the same step and state, and that state is the true one (nothing corrupted or
  half-received spread);
- no joining or half-filled replica gives its state;
- a loss that leaves a replica holding the state never takes the world path;
- a discarded step is resolved by the next epoch (its switch evens the split commit out).
Plus direct tests of each decision, each naming the issue's item it covers."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trainer.protocol import (
    Membership,
    NotContainable,
    ProtocolFault,
    Roster,
    SyncRow,
    batch_problem,
    form_order,
    gives_up,
    healing_counts,
    sync_plan,
)


def truth(step: int) -> int:
    """The state every correct replica holds after `step` steps (a hash chain)."""
    h = 0
    for s in range(1, step + 1):
        h = int.from_bytes(hashlib.blake2b(f"{h}/{s}".encode(), digest_size=6).digest(), "big")
    return h


class ReplicaModel:
    def __init__(self, step: int | None) -> None:
        self.step = step if step is not None else 0
        self.state: int | None = truth(step) if step is not None else -10**9 - id(self) % 1000
        """A replica formed again holds a fresh initialisation (a state of its own) until it receives."""
        self.received = step is not None
        self.partial = False
        self.changed_at_rest = False
        self.corrupted = False
        """Its state was corrupted since the last epoch switch (what the next switch must find)."""

    def row(self, joining: bool) -> SyncRow:
        if joining or self.partial:
            return SyncRow(self.step, None, joining=True)
        return SyncRow(self.step, None if self.changed_at_rest else self.state)


class Protocol(RuleBasedStateMachine):
    """The controller's Roster and D replicas' states, driven by the protocol's pure decisions."""

    def __init__(self) -> None:
        super().__init__()
        self.d = 0

    @rule(d=st.integers(2, 5), spares=st.integers(0, 3))
    @precondition(lambda self: self.d == 0)
    def start(self, d: int, spares: int) -> None:
        self.d, self.spares = d, spares
        self.roster, first = Roster.start(d)
        self.published = [first]
        self.replicas = {k: ReplicaModel(0) for k in range(d)}
        self.switched = first  # the epoch every member runs
        self.discard_pending: int | None = None
        self.world_paths = 0
        self.flips = 0
        self.unseen: set[int] = set()
        """Replicas holding a corruption nothing could see (the only member at the newest step, where
        its at-rest check does not look): the protocol's stated limit."""
        self.since_switch: set[int] = set()
        """Replicas corrupted since the last switch (the next one must find them)."""

    # -- what happens to the run --------------------------------------------------------------------
    @rule()
    @precondition(lambda self: self.d and self.in_sync())
    def train(self) -> None:
        for k in self.switched.replicas:
            r = self.replicas[k]
            r.step += 1
            r.state = truth(r.step) if not r.corrupted else (r.state or 0) - 1000

    @rule(data=st.data())
    @precondition(lambda self: self.d and self.in_sync() and len(self.switched.replicas) > 1)
    def split_commit(self, data: st.DataObject) -> None:
        """A collective fails on some members only: they discard the step, the others apply it."""
        members = list(self.switched.replicas)
        applied = data.draw(st.lists(st.sampled_from(members), unique=True, max_size=len(members) - 1))
        for k in applied:
            r = self.replicas[k]
            r.step += 1
            r.state = truth(r.step) if not r.corrupted else (r.state or 0) - 1000
        m = self.roster.resolve_discard(self.switched.epoch)
        assert m is not None and m.resync, "a discard with no newer epoch gets one (item 1)"
        assert set(m.replicas) == set(self.switched.replicas)
        self.publish(m)
        assert self.roster.resolve_discard(self.switched.epoch) is None, "one epoch resolves it: no storm"
        self.discard_pending = m.epoch

    @rule(data=st.data())
    @precondition(lambda self: self.d and (self.roster.members or self.roster.forming))
    def lose(self, data: st.DataObject) -> None:
        """A node loss: a member, a joining member or a forming replica."""
        k = data.draw(st.sampled_from(sorted(self.roster.members | set(self.roster.forming))))
        self.lose_replicas({k})

    @rule(data=st.data())
    @precondition(lambda self: self.d and self.roster.out and self.spares > 0)
    def form(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.roster.out)))
        self.spares -= 1
        self.roster.form(k, 1)
        self.replicas[k] = ReplicaModel(None)

    @rule(data=st.data())
    @precondition(lambda self: self.d and self.roster.forming)
    def ready(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.roster.forming)))
        m = self.roster.ready([k])
        assert m is not None and k in m.joining
        self.publish(m)

    @rule(data=st.data())
    @precondition(lambda self: self.d and len(self.holders()) > 0)
    def corrupt_at_rest(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.holders())))
        r = self.replicas[k]
        self.flips += 1
        r.state = -self.flips  # (a state no step's truth is, and no other flip's)
        r.corrupted = True
        self.since_switch.add(k)
        r.changed_at_rest = data.draw(st.booleans())  # its at-rest check saw it, or only a comparison can

    @rule()
    @precondition(lambda self: self.d)
    def controller_restarts(self) -> None:
        """A new controller takes the roster over from the newest epoch; replicas being formed are out
        (it forms them again: it did not start their processes)."""
        newest = self.published[-1]
        confirmed = set(newest.joining) - self.roster.joining
        self.roster = Roster.resume(self.d, newest, confirmed)
        assert self.roster.epoch == newest.epoch and self.roster.joining == set(newest.joining) - confirmed

    @rule(donor_dies=st.booleans())
    @precondition(lambda self: self.d and not self.in_sync())
    def switch(self, donor_dies: bool) -> None:
        """The members form the newest epoch and sync; a donor may die mid-transfer."""
        m = self.published[-1]
        rows = [self.replicas[k].row(k in m.joining) for k in m.replicas]
        plan = sync_plan(rows)
        # What the protocol cannot see: a state corrupted where its at-rest check does not look, held by
        # the only member at the newest step (nothing to compare it with). Anything else is found.
        alone = [k for k, r in zip(m.replicas, rows) if not r.joining and r.step == plan.newest]
        self.unseen |= {k for k in alone if len(alone) == 1 and self.replicas[k].corrupted
                        and not self.replicas[k].changed_at_rest}
        if plan.source is not None:
            source = m.replicas[plan.source]
            assert source not in m.joining and not self.replicas[source].partial, "a joiner never gives its state"
            assert self.replicas[source].received, "a replica formed again never gives its fresh state"
            given = rows[plan.source].fingerprint
            odd = {m.replicas[i] for i, r in enumerate(rows)
                   if not r.joining and r.step == plan.newest and r.fingerprint != given}
            assert odd <= {m.replicas[i] for i in plan.suspects}, "a member that differs is named, not overwritten (item 2)"
        if plan.corrupt:
            # nothing can be vouched for: the world path, back to the last verified state
            assert not self.vouchable(m), "corrupt only when no majority or intact holder exists"
            self.world_path()
            return
        if plan.suspects:
            self.lose_replicas({m.replicas[i] for i in plan.suspects})
            return
        if plan.source is None:
            self.switched = m
            self.after_switch(m)
            return
        receivers = [k for i, k in enumerate(m.replicas) if i != plan.source]
        given = self.replicas[m.replicas[plan.source]]
        if donor_dies and receivers:
            for k in receivers[: len(receivers) // 2 + 1]:  # half filled
                self.replicas[k].partial = True
                self.replicas[k].state = -(10**6) - k
            self.lose_replicas({m.replicas[plan.source]})
            return
        for k in receivers:
            r = self.replicas[k]
            r.step, r.state, r.partial, r.changed_at_rest, r.corrupted = given.step, given.state, False, False, given.corrupted
            r.received = True
            if given.corrupted:  # (from a source nothing could check: the same unseen corruption)
                self.unseen.add(k)
            else:
                self.unseen.discard(k)
        self.switched = m
        self.after_switch(m)

    # -- the controller's and the model's bookkeeping ---------------------------------------------------
    def publish(self, m: Membership) -> None:
        assert m.epoch == self.published[-1].epoch + 1 and self.roster.epoch == m.epoch
        assert set(m.joining) >= {k for k in m.replicas if not self.replicas[k].received}, \
            "every member that has not received the state is listed as joining (item 3)"
        self.published.append(m)

    def lose_replicas(self, lost: set[int]) -> None:
        holders_left = self.roster.holders - lost
        if holders_left and not any(self.replicas[k].partial or not self.replicas[k].received for k in holders_left):
            m = self.roster.lose(lost)  # never NotContainable: a holder is left (item 4)
        else:
            try:
                m = self.roster.lose(lost)
            except NotContainable:
                assert not holders_left
                self.world_path()
                return
        for k in lost:
            self.replicas[k] = ReplicaModel(None)
            self.unseen.discard(k)
            self.since_switch.discard(k)
        if m is not None:
            assert not set(m.replicas) & lost
            self.publish(m)

    def world_path(self) -> None:
        """A new attempt from the last verified state: every replica formed, epoch 0 of a new board."""
        self.world_paths += 1
        self.discard_pending = None
        self.unseen, self.since_switch = set(), set()
        verified = max((r.step for r in self.replicas.values() if r.received and not r.partial and not r.corrupted),
                       default=0)
        self.roster, first = Roster.start(self.d)
        self.published = [first]
        self.replicas = {k: ReplicaModel(verified) for k in range(self.d)}
        self.switched = first

    def after_switch(self, m: Membership) -> None:
        assert not any(self.replicas[k].corrupted for k in set(m.replicas) - self.unseen), "a switch left a corrupted member in"
        self.since_switch = set()
        self.roster.rejoined(m.joining)  # (each joiner's rank says it rejoined)
        for k in m.replicas:
            self.replicas[k].partial = False
        if self.discard_pending is not None and m.epoch >= self.discard_pending:
            self.discard_pending = None

    def in_sync(self) -> bool:
        return self.switched.epoch == self.published[-1].epoch

    def holders(self) -> set[int]:
        return {k for k in self.roster.holders if self.replicas[k].received and not self.replicas[k].partial}

    def vouchable(self, m: Membership) -> bool:
        rows = [self.replicas[k].row(k in m.joining) for k in m.replicas]
        newest = max(r.step for r in rows if not r.joining) if any(not r.joining for r in rows) else -1
        prints = [r.fingerprint for r in rows if not r.joining and r.step == newest and r.fingerprint is not None]
        return bool(prints) and max(prints.count(p) for p in prints) * 2 > len(prints)

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def members_agree_after_a_switch(self) -> None:
        if not self.d or not self.in_sync():
            return
        states = {(self.replicas[k].step, self.replicas[k].state) for k in self.switched.replicas
                  if not self.replicas[k].corrupted}
        assert len(states) <= 1, f"members of epoch {self.switched.epoch} differ: {states}"
        for k in self.switched.replicas:
            r = self.replicas[k]
            assert r.corrupted or r.state == truth(r.step), "a corrupted or half-received state spread"
            assert not r.corrupted or k in self.unseen or k in self.since_switch, "a corruption the protocol could see"

    @invariant()
    def a_discard_is_resolved_within_one_epoch(self) -> None:
        if self.d and self.discard_pending is not None:
            assert self.published[-1].epoch >= self.discard_pending

    @invariant()
    def roster_is_consistent(self) -> None:
        if not self.d:
            return
        r = self.roster
        assert r.joining <= r.members and not (r.members & set(r.forming))
        assert r.members | set(r.forming) | r.out == set(range(self.d))
        assert set(self.published[-1].replicas) == r.members


TestProtocol = Protocol.TestCase
TestProtocol.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


# -- each decision on its own ------------------------------------------------------------------------
def test_a_replica_joining_stays_joining_when_another_is_lost_before_it_got_the_state() -> None:
    """Item 3: `lose_replicas` published `joining=()`: a replica announced as joining but not yet given
    state came back as a full member (a donor)."""
    roster, _ = Roster.start(3)
    roster.lose([2])
    roster.form(2, 1)
    joined = roster.ready([2])
    assert joined is not None and joined.joining == (2,)
    after = roster.lose([0])
    assert after is not None and after.replicas == (1, 2) and after.joining == (2,) and after.holders == (1,)
    roster.rejoined([2])
    assert roster.resolve_discard(after.epoch).joining == ()  # type: ignore[union-attr]


def test_a_replica_lost_while_it_forms_changes_no_epoch_and_forms_again() -> None:
    """Item 4: a replica failing while it forms stopped the world."""
    roster, _ = Roster.start(2)
    roster.lose([1])
    roster.form(1, 1)
    assert roster.lose([1]) is None and roster.out == {1} and roster.members == {0}
    with pytest.raises(NotContainable):
        roster.lose([0])
    assert roster.members == {0}, "a refused loss changes nothing"


def test_a_discard_with_nothing_lost_gets_one_resync_epoch() -> None:
    """Item 1: the controller published nothing and the survivors waited for the hang verdict."""
    roster, first = Roster.start(2)
    m = roster.resolve_discard(first.epoch)
    assert m is not None and m.resync and m.replicas == (0, 1)
    assert roster.resolve_discard(first.epoch) is None
    assert gives_up(first, m, forming=False) is not None, "a resync gives up the old epoch's collectives"
    joined = Membership(2, (0, 1, 2), joining=(2,))
    assert gives_up(m, joined, forming=False) is None, "a join is switched to at the next step boundary"
    assert gives_up(m, joined, forming=True) is not None, "any newer epoch wins while one forms"


def test_sync_names_a_minority_member_instead_of_overwriting_it() -> None:
    """Item 2: a minority member was overwritten with no event."""
    plan = sync_plan([SyncRow(5, 9), SyncRow(5, 1), SyncRow(5, 1), SyncRow(-1, None, joining=True)])
    assert plan.suspects == (0,) and plan.source == 1 and plan.vouched_by == "majority of 3"
    tie = sync_plan([SyncRow(5, 9), SyncRow(5, 1), SyncRow(-1, None, joining=True)])
    assert tie.corrupt and tie.source is None
    alone = sync_plan([SyncRow(5, 1, checked=False), SyncRow(-1, None, joining=True)])
    assert alone.source == 0 and alone.vouched_by == "nothing (no at-rest check)"
    checked = sync_plan([SyncRow(5, 1), SyncRow(4, 1)])
    assert checked.source == 0 and checked.vouched_by == "its at-rest check"
    assert sync_plan([SyncRow(3, None, joining=True), SyncRow(3, None, joining=True)]).corrupt


def test_replicas_form_as_far_as_the_nodes_go() -> None:
    """Item 8: with one spare and two replicas out, neither formed again."""
    assert form_order([1, 2], {1: ["n1"], 2: ["n2"]}, ["s0"]) == {1: {"n1": "s0"}}
    assert form_order([1, 2], {1: ["a", "b"], 2: ["c"]}, ["s0"]) == {2: {"c": "s0"}}
    assert form_order([1], {1: []}, []) == {1: {}}, "a replica whose nodes are back forms in place"


def test_the_batch_is_checked_against_every_live_count_the_run_can_reach() -> None:
    """Item 6: the global batch under keep was checked only when an epoch switched."""
    assert list(healing_counts(4, 10)) == [1, 2, 3, 4] and list(healing_counts(8, 2)) == [6, 7, 8]
    assert batch_problem(24, dp_shard=1, micro_batch=1, replicas=4, max_failures=10) is None
    problem = batch_problem(16, dp_shard=1, micro_batch=1, replicas=4, max_failures=10)
    assert problem is not None and "3 live replica" in problem and "multiple of 12" in problem
    assert "batch_while_healing: shrink" in problem


def test_a_protocol_fault_is_named_and_checked() -> None:
    assert ProtocolFault.parse("reduce@2:step=5") == ProtocolFault("reduce", 2, 5)
    assert ProtocolFault.parse("sync@0:step=8:delay=30").delay_s == 30.0
    assert ProtocolFault.parse("sync@0:delay=10") == ProtocolFault("sync", 0, None, 10.0), "no step: the next time"
    for bad in ("reduce", "shout@1:step=2", "reduce@x", "reduce@1:step=2:when=3", "agree@1:step=2:delay=0",
                "reduce@1:step=-1"):
        with pytest.raises(ValueError, match="protocol fault"):
            ProtocolFault.parse(bad)
