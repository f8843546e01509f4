"""One data-parallel replica as the failure domain (DESIGN.md, "Failure domains").

A replica (dp_shard x pp x tp ranks on whole nodes) is its own torch.distributed world: its own
rendezvous prefix, its own FSDP / TP / PP groups. The only communicators that span replicas are one
per shard position (a rank's place inside its replica), of size D (the live replicas): the gradient
all-reduce runs there, after FSDP's reduce-scatter inside the replica. Losing a node then breaks one
replica's world and the cross-replica groups it was in, never the other replicas' worlds: survivors
discard the step in flight, take the next membership epoch from the controller (the one authority on
who is in), rebuild only their cross-replica groups (an init of size D, not W) and go on; a replica
formed again on a spare receives its state from a live one at a step boundary and joins.

The cross-replica groups are backends built directly on a store prefix per (epoch, position), as
torchft builds its reconfigurable process groups: a new epoch is a new prefix, so nothing of an
old epoch's rendezvous is read again, and no global process group is ever re-initialised.

Per step, inside `Trainer.train_step` (trainer/train.py):
1. forward and backward inside the replica (FSDP reduce-scatters over dp_shard);
2. `reduce`: one flat all-reduce of the local gradient shards over this position's cross-replica
   group, divided by D: every replica now holds the gradient of the whole global batch;
3. `vote`: one all-reduce (MAX) over the replica's world of [failed?, newest epoch seen]: the replica
   commits only if every position's reduce succeeded, and every rank learns the epoch to switch to;
4. `agree`: one all-reduce (MAX) over the cross-replica group of [failed?, that epoch, each
   replica's loss in its own slot], so every replica commits the same steps, switches epoch at the
   same step boundary and reports the same loss;
5. `vote` again inside the replica: a peer replica that died between two positions' agreements
   leaves them split, and the replica must commit or discard as one (its pipeline and TP
   collectives go on together);
6. the optimizer step. Any failure in 2-5 discards the step (gradients dropped, nothing applied):
   `StepDiscarded`. A replica whose own world broke cannot vote at all: `ReplicaBroken` (its ranks
   end; the controller forms it again).

Whatever a failure leaves uneven (a replica that applied a step another discarded) is made even at
the next epoch: `sync` finds the members' newest step and copies the whole state from the first
member that has it to every other member (a joining replica included), bit for bit.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from health.sdc import minority
from trainer import abandon
from trainer.membership import Membership, MembershipBoard  # noqa: F401 - (imported from here too)
from trainer.probes import SilentDataCorruption
from trainer.tensors import local_tensor
from trainer.protocol import ProtocolFault, SyncPlan, SyncRow, gives_up, sync_plan

FINGERPRINT_MASK = (1 << 52) - 1
"""State fingerprints travel in float64 collectives: 52 bits are exact there."""


class StepDiscarded(RuntimeError):
    """A collective across replicas failed in this step: nothing of it was applied, anywhere that
    agreed; the rank waits for the controller's next membership epoch and trains the step again."""


class ReplicaBroken(RuntimeError):
    """This rank's own replica cannot agree (a member of its world is gone): the replica is lost and
    its ranks end."""


class StateCorrupt(SilentDataCorruption):
    """At an epoch switch, members hold different states at the same step, or a state changed at
    rest (`plan` says who): the suspects leave, and with no majority nothing is copied anywhere."""

    def __init__(self, message: str, plan: SyncPlan, replicas: tuple[int, ...], mine: bool) -> None:
        super().__init__(message)
        self.plan = plan
        self.suspects = [replicas[i] for i in plan.suspects]
        self.mine = mine
        """Whether this rank's replica is a suspect (its ranks end and its nodes are quarantined)."""


class CrossReplica:
    """This rank's side of the cross-replica groups: the group of its shard position over the live
    replicas of the current epoch, rebuilt (on a fresh store prefix) at each new epoch."""

    def __init__(self, store: dist.Store, *, replica: int, position: int, device: torch.device,
                 timeout_s: float = 60.0, board: MembershipBoard | None = None, replicas: int | None = None,
                 keep_batch: bool = True, faults: Sequence[ProtocolFault] = ()) -> None:
        self.store = store
        self.replica = replica
        self.replicas = replicas
        """All the run's replicas (D), live or not; None: only the live ones count (`keep_batch`)."""
        self.keep_batch = keep_batch or replicas is None
        """While replicas are out: the live ones take their samples (the global batch is kept), or
        each replica keeps its own share and the missing replicas' samples are skipped."""
        self.position = position
        self.device = device
        self.timeout_s = timeout_s
        self.board = board or MembershipBoard(store)
        self.membership: Membership | None = None
        self.group: Any = None
        self.last_error = ""
        """Why the last cross-replica collective failed."""
        self.largest_group = 0
        """The largest cross-replica group this rank was ever in (a test bounds it by D)."""
        self.agreed_step = 0
        """The newest step whose state every live replica was seen to hold alike (the last step a
        replay from the store may trust when they stop agreeing)."""
        self._works: list[Any] = []
        """The current group's collectives not known to have ended (held with it if it is given up)."""
        self.graveyard = abandon.Graveyard()
        self._seen_epoch: tuple[int, int] = (-1, -1)
        self._newer: Membership | None = None
        self.last_plan: SyncPlan | None = None
        """The last epoch switch's plan (what vouched for the state given, `vouched_by`)."""
        self.partial = False
        """Whether this rank's state is part received (a transfer given up): it holds nothing it may give,
        as if it were joining, until a transfer completes."""
        self.forming = False
        """Whether this rank is forming its epoch (the group's init, the state transfer): any newer
        epoch then wins (trainer/protocol.gives_up)."""
        self.at_step = 0
        """The step this rank's collectives serve (the one being trained, or the first trained after the switch)."""
        self.faults = list(faults)
        """Faults to inject at named points of the protocol (tests and the protocol-fault drill)."""

    @property
    def live(self) -> int:
        assert self.membership is not None
        return len(self.membership.replicas)

    @property
    def index(self) -> int:
        """This replica's place among the live ones (its rank in the cross-replica group)."""
        assert self.membership is not None
        return self.membership.replicas.index(self.replica)

    def configure(self, membership: Membership) -> None:
        """Join this position's group of `membership` (every member's rank at this position meets
        here); given up (abandon.Abandoned) when a newer epoch is published meanwhile."""
        if self.replica not in membership.replicas:
            raise ReplicaBroken(f"replica {self.replica} is not in membership epoch {membership.epoch}")
        self.abort()
        prefix = dist.PrefixStore(f"cross/e{membership.epoch}/p{self.position}", self.store)
        self.membership = membership
        size = len(membership.replicas)
        self.inject("init")
        self.group = (abandon.build(prefix, self.index, size, self.device, self.timeout_s, give_up=self.superseded)
                      if size > 1 else None)
        self.largest_group = max(self.largest_group, size)

    def inject(self, point: str) -> None:
        """A fault a test or drill asked for at this named point of the protocol, at this step: a
        failed collective (RuntimeError), or one delayed by its seconds (past the timeout, when long)."""
        for fault in self.faults:
            if fault.point == point and fault.step in (None, self.at_step):
                self.faults.remove(fault)
                if fault.delay_s is None:
                    raise RuntimeError(f"injected protocol fault: {point} failed at step {self.at_step}")
                time.sleep(fault.delay_s)
                return

    def abort(self) -> None:
        """Give the current group up (a failed one may still have a collective pending on a dead peer:
        it is held until that ends, trainer/abandon.py)."""
        if self.group is not None:
            abandon.abort(self.group, self._works, self.graveyard)
        self.group, self._works = None, []

    def superseded(self) -> str | None:
        """Why a collective of this epoch is to be given up now (trainer/protocol.gives_up): the
        controller published a newer membership that leaves out one of its members (a lost replica)
        or resolves a discarded step, or any newer one while this epoch forms. None otherwise."""
        assert self.membership is not None
        newest = self.board.newest_epoch()
        if newest <= self.membership.epoch:
            return None
        if (newest, self.at_step) != self._seen_epoch:  # (a replayed log's epochs come due at their steps)
            self._seen_epoch = (newest, self.at_step)
            due = self.board.due(self.membership.epoch, self.at_step)
            self._newer = self.board.get(due) if due > self.membership.epoch else None
        return gives_up(self.membership, self._newer, forming=self.forming) if self._newer is not None else None

    def _wait(self, work: Any) -> None:
        self._works.append(work)
        try:
            abandon.wait(work, give_up=self.superseded, timeout_s=self.timeout_s)
            failed = abandon.errored(self.group)
            if failed is not None:  # (before anything it produced reaches the vote)
                raise RuntimeError(failed)
        except Exception:
            self.abort()  # (given up, timed out or failed: this group is done with)
            raise
        self._works.remove(work)

    def data_split(self, shard_rank: int, dp_shard: int) -> tuple[int, int]:
        """(dp ranks of the whole run, this rank's dp rank): replicas outermost, as HSDP orders them.
        Keeping the batch, over the live replicas; shrinking it, over all of them (each replica keeps
        its own share of the samples; the missing ones' are skipped)."""
        if self.keep_batch:
            return self.live * dp_shard, self.index * dp_shard + shard_rank
        assert self.replicas is not None
        return self.replicas * dp_shard, self.replica * dp_shard + shard_rank

    def skipped(self) -> tuple[int, ...]:
        """The replicas whose share of each step's samples is skipped now (shrinking the batch)."""
        if self.keep_batch or self.membership is None or self.replicas is None:
            return ()
        return tuple(sorted(set(range(self.replicas)) - set(self.membership.replicas)))

    def _all_reduce(self, buf: torch.Tensor, op: Any) -> None:
        if self.group is None:
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._wait(self.group.allreduce([buf], opts))

    def reduce(self, parts: Sequence[nn.Module]) -> bool:
        """The mean over the live replicas of every local gradient shard, in place: one flat all-reduce
        per dtype. Whether every live replica gave its part (the loss travels with `agree`)."""
        grads = [local_tensor(p.grad) for part in parts for p in part.parameters() if p.grad is not None]
        try:
            self.inject("reduce")
            for dtype, same in _by_dtype(grads):
                flat = torch.cat([g.reshape(-1) for g in same])
                self._all_reduce(flat, dist.ReduceOp.SUM)
                flat /= self.live
                torch._foreach_copy_(same, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in same]), same)])
        except Exception as e:  # noqa: BLE001 - a peer replica is gone (its socket closed, or the timeout)
            self.last_error = f"{type(e).__name__}: {e}"[:500]
            return False
        return True

    def vote(self, ok: bool, epoch_seen: int, skip: bool = False,
             marks: Sequence[float] = ()) -> tuple[bool, int, bool, list[float]]:
        """Inside the replica (its own world): did every position's reduce succeed, the newest epoch
        any member saw, whether any holds the update back (its probes' loss anomaly: the step is done
        without an update, everywhere), and the largest of each of `marks` (what any position found).
        ReplicaBroken if the replica's own world cannot answer."""
        buf = torch.tensor([0.0 if ok else 1.0, float(epoch_seen), 1.0 if skip else 0.0, *marks], dtype=torch.float64,
                           device=self.device)
        try:
            self.inject("vote")
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        except Exception as e:  # noqa: BLE001 - a member of this replica is gone
            raise ReplicaBroken(f"replica {self.replica}'s own world failed: {e}") from e
        values = buf.tolist()
        return values[0] == 0.0, int(values[1]), values[2] > 0.0, values[3:]

    def agree(self, ok: bool, epoch: int, skip: bool = False, fingerprint: int | None = None,
              loss: torch.Tensor | None = None) -> tuple[bool, int, bool, list[int] | None, float | None]:
        """Across the live replicas at this position, in one all-reduce (MAX): commit only if every
        replica can, switch to the newest epoch any of them saw, hold the update back if any does;
        given this rank's state fingerprint (every replica gives one at the same steps), every live
        replica's, in replica order; and the mean of the replicas' losses (last-stage ranks give
        theirs: each its own slot, summed here in replica order; NaN if any is not finite), or None
        where no rank gave one."""
        slots = [-1.0] * self.live
        if fingerprint is not None:
            slots[self.index] = float(fingerprint & FINGERPRINT_MASK)
        losses = [-math.inf] * self.live  # (MAX keeps a NaN only by the operands' order: +inf stands for it)
        if loss is not None:
            value = float(loss.detach().double())
            losses[self.index] = value if math.isfinite(value) else math.inf
        buf = torch.tensor([0.0 if ok else 1.0, float(epoch), 1.0 if skip else 0.0, *slots, *losses],
                           dtype=torch.float64, device=self.device)
        try:
            self.inject("agree")
            self._all_reduce(buf, dist.ReduceOp.MAX)
        except Exception as e:  # noqa: BLE001
            self.last_error = f"{type(e).__name__}: {e}"[:500]
            return False, epoch, skip, None, None
        values = buf.tolist()
        fingerprints = [int(v) for v in values[3:3 + self.live]] if fingerprint is not None else None
        given = [v for v in values[3 + self.live:] if v != -math.inf]
        mean = (math.nan if math.inf in given else sum(given) / len(given)) if given else None
        return values[0] == 0.0, int(values[1]), values[2] > 0.0, fingerprints, mean

    def odd_marks(self, fingerprints: list[int] | None) -> list[float]:
        """What this position's fingerprints say, as `vote` marks: [no majority?, then per live replica:
        does it differ from the majority (every replica, with no majority)?]."""
        if fingerprints is None:
            return [0.0] * (self.live + 1)
        odd, tie = minority(dict(enumerate(fingerprints)))
        return [1.0 if tie else 0.0] + [1.0 if i in odd else 0.0 for i in range(self.live)]

    def judged_by_probes(self, suspect: bool) -> set[int]:
        """The live replicas (by index) whose own probes found a suspect rank just now, from each
        replica's `suspect` (its probes' verdict, the same on every rank of the replica)."""
        slots = [0.0] * self.live
        slots[self.index] = 1.0 if suspect else 0.0
        buf = torch.tensor(slots, dtype=torch.float64, device=self.device)
        self._all_reduce(buf, dist.ReduceOp.MAX)
        return {i for i, v in enumerate(buf.tolist()) if v > 0.0}

    def compare(self, value: int) -> list[int]:
        """Every live replica's `value` at this position, in replica order (a state checksum: replicas
        that disagree with no failure between them hold corrupted state)."""
        mine = torch.zeros(self.live, dtype=torch.int64, device=self.device)
        mine[self.index] = value
        self._all_reduce(mine, dist.ReduceOp.SUM)
        return [int(v) for v in mine.tolist()]

    def sync(self, tensors: Callable[[], list[torch.Tensor]], step: int, cursor: int,
             intact: bool | None = True) -> tuple[int, int, int | None, SyncPlan | None]:
        """Make every member's state the newest member's: the members exchange their steps and state
        fingerprints, and trainer/protocol.sync_plan decides; if anything is to move, the vouched
        member broadcasts `tensors` (and its step and cursor) to all. `intact`: its probes' check of
        the state at rest (None: not checked). StateCorrupt when members at the newest step disagree
        (on every member: the suspects leave before the transfer, the others' transfer waits for the
        epoch without them) or none can be vouched for (nothing is copied). (step, cursor, source
        replica or None when nothing moved, the plan)."""
        from trainer.tensors import bits_checksum

        assert self.membership is not None
        m = self.membership
        if self.group is None:
            return step, cursor, None, None
        size = len(m.replicas)
        joining = self.replica in m.joining or self.partial  # (a transfer cut off left a state no one vouches for)
        fingerprint = -1.0 if joining or intact is False else float(bits_checksum(tensors()) & FINGERPRINT_MASK)
        mine = torch.zeros(size, 4, dtype=torch.float64, device=self.device)
        mine[self.index] = torch.tensor([float(step), float(cursor), fingerprint,
                                         (1.0 if joining else 0.0) + (2.0 if intact is None else 0.0)],
                                        dtype=torch.float64)
        self._all_reduce(mine, dist.ReduceOp.SUM)
        rows = mine.tolist()
        plan = self.last_plan = sync_plan([SyncRow(int(row[0]), int(row[2]) if row[2] >= 0 else None, joining=int(row[3]) & 1 == 1,
                                  checked=int(row[3]) & 2 == 0) for row in rows])
        if plan.corrupt or self.index in plan.suspects:
            suspects = [m.replicas[i] for i in plan.suspects]
            why = ("no majority of the members at step {0} holds one state, or none is intact at rest" if plan.corrupt
                   else "its state differs from the majority's at step {0}, or changed at rest").format(plan.newest)
            raise StateCorrupt(f"membership epoch {m.epoch}: replica(s) {suspects}: {why}; nothing is copied from them",
                               plan, m.replicas, mine=self.index in plan.suspects or plan.corrupt)
        if plan.source is None:
            return step, cursor, None, plan
        if plan.suspects:  # (they left: this transfer waits for the epoch without them)
            raise StateCorrupt(f"membership epoch {m.epoch}: replica(s) {[m.replicas[i] for i in plan.suspects]} hold "
                               "a corrupted state and leave", plan, m.replicas, mine=False)
        root = plan.source
        # Until every tensor is in, a receiver whose state differs from the donor's holds a mix if the
        # donor dies mid-transfer; a member that already holds the donor's step and bytes receives what
        # it has, and can still give (at D >= 3 it is the one left to heal the joiner from).
        mine_row, root_row = rows[self.index], rows[root]
        holds_it = int(mine_row[3]) & 1 == 0 and mine_row[2] >= 0 and mine_row[:3] == root_row[:3]
        self.partial = self.index != root and not holds_it
        self.inject("sync")
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        for t in tensors():
            if not t.is_contiguous():
                raise ValueError("a replica's state tensor is not contiguous: it cannot be received in place")
            # NCCL moves device memory only: a host-side tensor (AdamW's step count) goes through the
            # device; a receiver takes it into a copy of its own (a broadcast given up must not write
            # into the state later, should its sender come back)
            staged = t.to(self.device) if t.device != self.device or self.index == root else t.clone()
            self._wait(self.group.broadcast([staged], opts))
            if staged is not t:
                t.copy_(staged)
        self.partial = False
        return plan.newest, int(rows[root][1]), m.replicas[root], plan


def _by_dtype(tensors: list[torch.Tensor]) -> Iterator[tuple[torch.dtype, list[torch.Tensor]]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    yield from groups.items()


def state_tensors(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor of a rank's training state, in an order every replica agrees on: each part's
    local parameter shards, then its optimizer's state (created if the optimizer has not stepped yet,
    as zeros of the same shape: a joining replica receives into them)."""
    out: list[torch.Tensor] = []
    for part, opt in zip(parts, optimizers):
        params = list(part.parameters())
        out.extend(local_tensor(p.data) for p in params)
        for p in params:
            state = opt.state[p]
            if not state:
                state.update(_fresh_state(opt, p))
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    out.append(local_tensor(value))
    return out


def _fresh_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state before its first step (what `sync` overwrites with a live replica's)."""
    if not isinstance(opt, torch.optim.AdamW | torch.optim.Adam):
        raise TypeError(f"the replica failure domain copies AdamW state; {type(opt).__name__} is not supported")
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    step_device = p.device if (group.get("fused") or group.get("capturable")) else torch.device("cpu")
    state = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def checksum(tensors: Sequence[torch.Tensor]) -> str:
    """A digest of a rank's state, equal across replicas exactly when their bytes are."""
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replica_step(trainer: Any, *, wait_s: float, log: list[dict[str, Any]],
                 on_discarded: Any = None) -> Any:
    """One step committed by every live replica (trainer.train.Trainer with `replicas`, configured):
    a discarded step waits for the controller's next membership and is trained again under it; an
    epoch every replica agreed on is switched to at the step boundary after it. Its StepReport.
    ReplicaBroken when this replica is no longer a member. `log` gets what happened, in order
    ({kind: step | discarded | switched | switch_failed, ...}); `on_discarded(detail)` is told of
    each discarded step and failed switch at once (the controller publishes the epoch that resolves
    it: trainer/protocol.Roster.resolve_discard)."""
    r: CrossReplica = trainer.replicas
    assert r.membership is not None, "configure the first membership (Trainer.switch) before training"
    while True:
        try:
            report = trainer.train_step()
        except StepDiscarded as e:
            detail = {"kind": "discarded", "step": trainer.step + 1, "epoch": r.membership.epoch, "time": time.time(),
                      "error": str(e)[:300]}
            log.append(detail)
            if on_discarded is not None:
                on_discarded(detail)
            switch_to(trainer, r.board.wait_newer(r.membership.epoch, wait_s), wait_s=wait_s, log=log,
                      on_failed=on_discarded)
            continue
        log.append({"kind": "step", "step": trainer.step, "epoch": r.membership.epoch, "loss": report.loss,
                    "time": report.end_time})
        if trainer.next_epoch is not None:
            switch_to(trainer, r.board.get(trainer.next_epoch), wait_s=wait_s, log=log, on_failed=on_discarded)
        return report


def switch_to(trainer: Any, membership: Membership, *, wait_s: float, log: list[dict[str, Any]],
              on_failed: Any = None) -> None:
    """`trainer.switch` to `membership`, or to a newer epoch: the replica's ranks first agree on the
    newest epoch any of them read (each read the board on its own), and when a member fails while
    it forms, they wait for the next one the controller publishes (told at once through
    `on_failed`). ReplicaBroken when this replica is not in it; SilentDataCorruption when its state
    is the corrupted one (its ranks end: an `sdc_suspect` names them)."""
    r: CrossReplica = trainer.replicas
    while True:
        _, newest, _, _ = r.vote(True, membership.epoch)
        if newest > membership.epoch:  # (a sibling rank read a newer epoch: every rank forms that one)
            membership = r.board.get(newest)
        t0 = time.time()
        error, corrupt = "", None
        try:
            source = trainer.switch(membership)
        except ReplicaBroken:
            raise
        except StateCorrupt as e:  # (every position's verdict is voted on below: the replica decides as one)
            error, corrupt = str(e)[:300], e
        except Exception as e:  # noqa: BLE001 - a member failed while the epoch formed: wait for the next
            error = f"{type(e).__name__}: {e}"[:300]
        mark = [1.0 if corrupt is not None and corrupt.mine else 0.0,
                1.0 if corrupt is not None and corrupt.plan.corrupt else 0.0]
        ok, _, _, marks = r.vote(not error, membership.epoch, marks=mark)  # every position formed it, or none goes on
        if marks[0] > 0:
            _leave_corrupted(trainer, membership, contained=marks[1] == 0, here=mark[0] > 0, why=error)
        if not ok:
            detail = {"kind": "switch_failed", "epoch": membership.epoch, "step": trainer.step, "time": time.time(),
                      "error": error or "another position's failed"}
            log.append(detail)
            if on_failed is not None and corrupt is None:  # (a suspect's leaving brings the next epoch anyway)
                on_failed(detail)
            membership = r.board.wait_newer(membership.epoch, wait_s)
            continue
        log.append({"kind": "switched", "epoch": membership.epoch, "step": trainer.step, "live": r.live,
                    "source": source, "time": time.time(), "seconds": time.time() - t0})
        return


def _leave_corrupted(trainer: Any, membership: Membership, *, contained: bool, here: bool, why: str) -> None:
    """An epoch switch found this replica's state corrupted (at some position: `here` at this
    rank's): its replica-world rank 0 says so (`sdc_suspect`: the ranks whose shard diverged, or all
    of them; `contained` when the other members vouch for their own state), and every rank ends."""
    r: CrossReplica = trainer.replicas
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=r.device)
    flags[dist.get_rank()] = 1 if here else 0
    dist.all_reduce(flags)
    offset = getattr(trainer, "rank_offset", 0)
    ranks = [offset + i for i, v in enumerate(flags.tolist()) if v] or [offset + i for i in range(dist.get_world_size())]
    if dist.get_rank() == 0 and trainer.sink is not None:
        trainer.sink.event("sdc_suspect", {
            "step": trainer.step, "check": "replica_sync", "anomaly": None, "ranks": ranks,
            "evidence": {str(rank): [why] for rank in ranks}, "replicas": [r.replica], "contained": contained,
            "clean_through_step": r.agreed_step, "epoch": membership.epoch})
    raise SilentDataCorruption(f"membership epoch {membership.epoch}: replica {r.replica}'s state is corrupted "
                               f"(ranks {ranks}): {why}")


def train_replica(trainer: Any, steps: int, *, wait_s: float, on_step: Any = None) -> list[dict[str, Any]]:
    """Train `trainer` to `steps` as one replica among the live ones (`replica_step` after step);
    what happened, in order. Ends when the steps are done, or with ReplicaBroken when this replica is
    no longer a member."""
    log: list[dict[str, Any]] = []
    while trainer.step < steps:
        report = replica_step(trainer, wait_s=wait_s, log=log)
        if on_step is not None:
            on_step(report)
    return log
