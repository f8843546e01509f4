"""The replica protocol's decisions (failure_domain replica), pure: no torch, no Ray, no clock.

A rank (trainer/replica.py) and the controller (controller/ray/replicas.py) act; this module
decides, so that a property test can drive every decision through random interleavings of failed
collectives, node losses, replicas becoming ready, donors dying mid-transfer and controller
restarts (tests/unit/test_protocol.py):
- `Membership`: one epoch, as the controller publishes it;
- `Roster`: the controller's side: which epoch follows a loss, a replica ready to join, a rejoin, or
  a step discarded with nothing lost;
- `gives_up`: whether a rank drops what it is doing in its epoch for a newer one;
- `sync_plan`: at an epoch switch, who gives its state to whom, and who is suspect;
- `form_order`: which replicas form again with the nodes there are;
- `healing_counts` / `batch_problem`: the live counts a run can reach, and whether its batch splits
  over each.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, Sequence

from health.sdc import minority


@dataclass(frozen=True)
class Membership:
    """Who trains, as the controller publishes it: epoch after epoch, never reused."""

    epoch: int
    replicas: tuple[int, ...]
    """The live replica ids, ascending: the cross-replica groups' members in this order."""
    joining: tuple[int, ...] = ()
    """Members formed again that have not been seen to hold the others' state yet: they receive it
    when the epoch starts (listed again in every epoch until their rejoin is confirmed)."""
    at_step: int = 0
    """The first step trained under this epoch at the earliest (a replay of a membership log gives
    each epoch's step; a live controller gives 0: at the next step boundary all replicas agree on)."""
    resync: bool = False
    """Published to resolve a discarded step with no replica lost: every collective of an earlier
    epoch is given up, and the members form this one and even out their state (`sync_plan`)."""

    def __post_init__(self) -> None:
        if list(self.replicas) != sorted(set(self.replicas)) or not self.replicas:
            raise ValueError(f"membership epoch {self.epoch}: replicas {self.replicas} must be distinct, ascending, non-empty")
        if not set(self.joining) <= set(self.replicas):
            raise ValueError(f"membership epoch {self.epoch}: joining {self.joining} not among replicas {self.replicas}")
        if set(self.joining) == set(self.replicas):
            raise ValueError(f"membership epoch {self.epoch}: every replica is joining, none can give its state")

    @property
    def holders(self) -> tuple[int, ...]:
        """The members that hold the run's state (every member but the joining ones)."""
        return tuple(r for r in self.replicas if r not in self.joining)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Membership":
        raw = json.loads(text)
        return cls(int(raw["epoch"]), tuple(raw["replicas"]), tuple(raw.get("joining", ())), int(raw.get("at_step", 0)),
                   bool(raw.get("resync", False)))


def gives_up(current: Membership, newer: Membership, *, forming: bool) -> str | None:
    """Why a rank drops what it does under `current` for `newer` (published later), or None.
    Forming an epoch (its group's init, its state transfer): any newer epoch wins, so every rank ends
    up forming the newest. Training: a newer epoch that leaves out a member (lost: its collectives
    will never end) or resolves a discarded step; one that only adds joining replicas is switched to
    at the next step boundary instead."""
    if newer.epoch <= current.epoch:
        return None
    if forming:
        return f"membership epoch {newer.epoch} was published while epoch {current.epoch} formed"
    out = sorted(set(current.replicas) - set(newer.replicas))
    if out:
        return f"membership epoch {newer.epoch} leaves out replica(s) {out}: epoch {current.epoch}'s collective is given up"
    if newer.resync:
        return f"membership epoch {newer.epoch} resolves a discarded step: epoch {current.epoch}'s collective is given up"
    return None


class NotContainable(RuntimeError):
    """No member that holds the run's state would be left: the world path takes over."""


@dataclass
class Roster:
    """The controller's account of an attempt's replicas (it alone publishes epochs): the members of
    the newest epoch, those among them still joining, the replicas being formed again (not members
    yet: replica -> incarnation), and the rest out, waiting for nodes. Each change returns the epoch
    to publish, or None when the members do not change."""

    replicas: int
    """D: every replica of the attempt, live or not."""
    epoch: int = 0
    members: frozenset[int] = frozenset()
    joining: frozenset[int] = frozenset()
    forming: dict[int, int] = field(default_factory=dict)

    @classmethod
    def start(cls, replicas: int, joining: Iterable[int] = ()) -> tuple["Roster", Membership]:
        """Epoch 0: every replica a member (`joining`: those whose nodes hold no copy of the state the
        others load, e.g. a peer snapshot step)."""
        roster = cls(replicas, 0, frozenset(range(replicas)), frozenset(joining))
        return roster, roster._membership(0)

    @classmethod
    def resume(cls, replicas: int, newest: Membership, confirmed: Iterable[int] = ()) -> "Roster":
        """The roster a restarted controller takes over from the newest epoch in the run's store:
        its members, its joining ones (less those the timeline saw rejoin: `confirmed`), and every
        other replica out (its processes were not formed by this controller: they are formed again)."""
        return cls(replicas, newest.epoch, frozenset(newest.replicas), frozenset(newest.joining) - set(confirmed))

    @property
    def out(self) -> frozenset[int]:
        """Replicas neither members nor forming: waiting for nodes to form on."""
        return frozenset(range(self.replicas)) - self.members - set(self.forming)

    @property
    def holders(self) -> frozenset[int]:
        return self.members - self.joining

    def _membership(self, epoch: int, resync: bool = False) -> Membership:
        return Membership(epoch, tuple(sorted(self.members)), tuple(sorted(self.joining)), resync=resync)

    def _next(self, resync: bool = False) -> Membership:
        self.epoch += 1
        return self._membership(self.epoch, resync)

    def can_lose(self, lost: Iterable[int]) -> bool:
        """Whether a member holding the state is left once `lost` are out."""
        return bool(self.holders - set(lost))

    def lose(self, lost: Iterable[int]) -> Membership | None:
        """`lost` replicas (members, joining members or forming ones) are out: the epoch without the
        members among them, or None when none was a member (a forming one just stops forming).
        NotContainable when no member holding the state would be left (the roster is unchanged)."""
        lost = set(lost) & set(range(self.replicas))
        if not self.can_lose(lost):
            raise NotContainable(f"losing replica(s) {sorted(lost)} leaves no replica that holds the state "
                                 f"(members {sorted(self.members)}, joining {sorted(self.joining)})")
        for replica in lost:
            self.forming.pop(replica, None)
        gone = self.members & lost
        if not gone:
            return None
        self.members -= gone
        self.joining -= gone
        return self._next()

    def form(self, replica: int, incarnation: int) -> None:
        """`replica` (out) is being formed again as `incarnation`."""
        if replica in self.members:
            raise ValueError(f"replica {replica} is a member of epoch {self.epoch}: it is not formed again")
        self.forming[replica] = incarnation

    def ready(self, ready: Iterable[int]) -> Membership | None:
        """Forming replicas whose every rank has built its replica's world join at the next epoch
        (as joining members: a holder gives them its state when it starts)."""
        new = {r for r in ready if r in self.forming}
        if not new:
            return None
        for replica in new:
            del self.forming[replica]
        self.members |= new
        self.joining |= new
        return self._next()

    def rejoined(self, replicas: Iterable[int]) -> None:
        """Joining members seen to hold the state (their rejoin reported): holders from now on. Later
        epochs list them as full members (a holder may give its state)."""
        self.joining -= set(replicas)

    def resolve_discard(self, epoch: int) -> Membership | None:
        """A rank discarded a step under `epoch` (a collective failed or timed out) and waits for the
        next epoch: if none was published since, one with the same members that gives up every
        collective of the old one and evens the members' state out (a split commit: some members
        applied the step, others did not). None when a newer epoch already answers it."""
        if epoch < self.epoch:
            return None
        return self._next(resync=True)


@dataclass(frozen=True)
class SyncRow:
    """What a member says at an epoch switch: its step, and its state's fingerprint, or None when it
    cannot vouch for it (joining: it holds nothing yet; or its parameters changed at rest)."""

    step: int
    fingerprint: int | None
    joining: bool = False
    checked: bool = True
    """Whether its at-rest check ran (the probes' record); False: its fingerprint is unchecked."""


@dataclass(frozen=True)
class SyncPlan:
    """What an epoch switch does with the members' state (indices are places among the members)."""

    newest: int
    """The newest step a member holds."""
    source: int | None
    """The member that gives its state to every other, or None when nothing moves."""
    suspects: tuple[int, ...] = ()
    """Members whose state differs from the majority's at the newest step, or changed at rest:
    corrupted; they leave (their nodes are quarantined) and receive nothing."""
    corrupt: bool = False
    """No member's state at the newest step can be vouched for: nothing is copied anywhere."""
    vouched_by: str = ""
    """What vouches for the source: `majority of N`, `its at-rest check` or `nothing (no at-rest check)`."""


def sync_plan(rows: Sequence[SyncRow]) -> SyncPlan:
    """Who gives its state at an epoch switch. A donor holds the state (not joining), is at the
    newest step, its state intact at rest, and its fingerprint that of the strict majority of such
    members; the first in member order gives. Members at the newest step outside the majority, and
    any whose state changed at rest, are suspects. With no majority (or no intact member at the
    newest step) the state is corrupt: nothing moves (a donor nobody can vouch for would spread it)."""
    if not rows:
        raise ValueError("an epoch switch needs at least one member")
    holding = [i for i, row in enumerate(rows) if not row.joining]
    if not holding:  # (a transfer cut off everywhere: no member holds a whole state)
        return SyncPlan(-1, None, corrupt=True)
    newest = max(rows[i].step for i in holding)
    changed = tuple(i for i in holding if rows[i].fingerprint is None)
    if (len(holding) == len(rows) and not changed and len({rows[i].step for i in holding}) == 1
            and len({rows[i].fingerprint for i in holding}) == 1):
        return SyncPlan(newest, None)
    candidates = {i: rows[i].fingerprint for i in holding if rows[i].step == newest and rows[i].fingerprint is not None}
    odd, tie = minority({i: int(v) for i, v in candidates.items() if v is not None})
    suspects = tuple(sorted(set(changed) | (odd if not tie else set())))
    vouched = [i for i in sorted(candidates) if i not in odd] if not tie else []
    if not vouched:
        return SyncPlan(newest, None, tuple(sorted(set(changed) | set(candidates))), corrupt=True)
    source = vouched[0]
    if len(vouched) > 1:
        how = f"majority of {len(candidates)}"
    elif rows[source].checked:
        how = "its at-rest check"
    else:
        how = "nothing (no at-rest check)"
    return SyncPlan(newest, source, suspects, vouched_by=how)


def form_order(waiting: Sequence[int], missing: Mapping[int, Sequence[str]], free: Sequence[str]) -> dict[int, dict[str, str]]:
    """Which of the replicas `waiting` (in this order) form again with the nodes `free` (spares
    first, then idle healthy ones): each takes as many as it misses (`missing`: replica -> its nodes
    that cannot take it), while they last; the others stay out (replica -> {missing node: its place})."""
    left = list(free)
    out: dict[int, dict[str, str]] = {}
    for replica in waiting:
        need = list(missing.get(replica, ()))
        if len(need) > len(left):
            continue  # (a later replica that misses fewer nodes may still fit)
        out[replica] = dict(zip(need, left))
        left = left[len(need):]
    return out


def healing_counts(replicas: int, max_failures: int) -> range:
    """The live replica counts a run can train with: any number of replicas may be out at once, up to
    one per failure it may still survive, and at least one lives."""
    return range(max(1, replicas - max_failures), replicas + 1)


def batch_problem(global_batch: int, *, dp_shard: int, micro_batch: int, replicas: int, max_failures: int) -> str | None:
    """Keeping the global batch while replicas are out, the live ones split it: why it does not split
    over some live count the run can reach, or None."""
    bad = [n for n in healing_counts(replicas, max_failures) if global_batch % (n * dp_shard * micro_batch)]
    if not bad:
        return None
    need = 1
    for n in healing_counts(replicas, max_failures):
        split = n * dp_shard * micro_batch
        need = need * split // _gcd(need, split)
    return (f"train.global_batch = {global_batch} does not split over {_counts(bad)} live replica(s) x dp_shard "
            f"{dp_shard} x micro_batch {micro_batch}, which elastic.batch_while_healing: keep reaches (up to "
            f"{min(max_failures, replicas - 1)} of {replicas} replicas out): choose a global batch that is a multiple of "
            f"{need}, or batch_while_healing: shrink (each replica keeps its own share)")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _counts(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:6]) + (f" and {len(values) - 6} more" if len(values) > 6 else "")


PROTOCOL_POINTS = ("init", "reduce", "vote", "agree", "sync")
"""The named points of a step and an epoch switch where a fault can be injected: the epoch's group
init, the gradient all-reduce, the vote inside a replica, the agreement across replicas, and the
state transfer of an epoch switch."""


@dataclass(frozen=True)
class ProtocolFault:
    """A fault injected at a named point of the protocol on one rank at one step: its collective
    fails, or (with `delay_s`) starts that many seconds late (past the timeout, when long)."""

    point: str
    rank: int
    step: int | None
    """None: the next time the rank reaches the point (a drill, armed between steps)."""
    delay_s: float | None = None

    def __post_init__(self) -> None:
        if self.point not in PROTOCOL_POINTS:
            raise ValueError(f"protocol fault point {self.point!r} is not one of {', '.join(PROTOCOL_POINTS)}")
        if self.rank < 0 or (self.step is not None and self.step < 0):
            raise ValueError(f"a protocol fault names a rank and a step >= 0 (got rank {self.rank}, step {self.step})")
        if self.delay_s is not None and self.delay_s <= 0:
            raise ValueError(f"a protocol fault's delay must be > 0 s (got {self.delay_s})")

    @classmethod
    def parse(cls, text: str) -> "ProtocolFault":
        """`POINT@RANK[:step=N][:delay=SECONDS]`, e.g. `reduce@2:step=5` or `sync@0:step=8:delay=30`; with
        no step, the next time the rank reaches the point (`sync@0:delay=10`: its next transfer)."""
        try:
            head, *options = text.split(":")
            point, rank = head.split("@")
            values = dict(o.split("=", 1) for o in options)
            unknown = set(values) - {"step", "delay"}
            if unknown:
                raise ValueError
            delay = float(values["delay"]) if "delay" in values else None
            return cls(point.strip(), int(rank), int(values["step"]) if "step" in values else None, delay)
        except ValueError as e:
            why = f": {e}" if str(e) else ""
            raise ValueError(f"protocol fault {text!r}: expected POINT@RANK[:step=N][:delay=SECONDS]{why}") from None
