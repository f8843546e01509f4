"""The simulated edge's worker group, on a virtual clock with a simulated cluster (controller.sim.cluster)
and an object store, for the real RunController to drive (controller.sim.run). Pure: no ray, torch or
boto3.

The worker group behaves as the Ray one does, seen from the controller: a launch costs the cost
model's restart (plus its restore when resuming), then steps end every `step_s`; a save blocks the
loop for the staging stall and commits a real manifest `checkpoint_save_s` later (retention as the
trainer applies it); the interval is every N steps or, for `auto`, the Young/Daly interval from the
first save's stall, with the MTBF the controller passes (checkpointing.schedule, the trainer's rule).
An incident stops the group at its time and shows up in a poll as what the Ray edge would report,
after the latency it would take: a lost node (GPU or host, or a host gone dark) as a dead node after
the detection latency, the data plane's for a loud one and the heartbeat's for a silent one
(controller.sim.model says which are which); a network fault or a hung rank (software's silent
share) as collective errors after the collective timeout (unless the controller's hang verdict comes
first); another software or storage fault as a worker error at once; silent data
corruption as the probes' `sdc_suspect` at the next step; a straggler (an incident or a slow-rank
drill) as slower steps, and as every rank's compute time for the steps the judgement needs.

Straggler judgement: when a rank of the mesh turns slow (and when an attempt starts with one in it),
the next `judged_steps` steps carry synthetic compute times for every rank — the healthy step's
compute share with 2 % noise, the slow ranks' `factor` times that — as whole steps
(`PollResult.compute`), which the controller's real straggler tracker judges as it judges reports:
verdicts, `straggler` events and, under `straggler_action: replace`, the node swapped for a spare at
the next checkpoint. Outside those stretches nothing is sampled: a healthy stretch has nothing to
judge, and 131,072 ranks' samples every step of 54 days would take days.

Peer snapshots (`checkpoint.peer_every_steps`) stall the loop for the host copy and reach the buddies
`peer_transfer_s` later; `peer_copies` answers as the nodes would: every rank's own copy on its node
and its buddy's copy on the buddy's, except on nodes lost since, and no buddy copies at all when the
failure struck while they were being rewritten (then the recovery falls back to the store); each
node answers with one `Held` record naming the ranks it keeps, as a Ray node does.

Replica failure domain (`failure_domain: replica` on the attempt; controller/sim/replicas.py): a lost
node pauses the survivors at its time (the step in flight is discarded) and shows up after
`replica_detection_s` (loud) or `silent_detection_s` (silent) as a dead node; the controller's
`lose_replicas` lets them go on after one cross-replica init, at D-1 of D replicas' throughput (keeping
the batch: longer steps; shrinking it: fewer tokens per step); `form_replicas` starts the lost ones warm
on their new nodes, and at the first step boundary after that the survivors stall for the state transfer
and one more cross-replica init, and report `replica_rejoined`. An incident on a node that holds only
replicas already out stops nothing.

Polls: the group says when it next has something to say (`next_wake`): a signal, a formed replica's
rejoin, the end of a chunk of steps, and a commit only from `commits_from` on (the driver sets it to
when the controller could act on one). The commits before it are heard at the next poll, with the
steps, as a controller that polls rarely hears them: at 131,072 GPUs Young/Daly saves every step,
and a poll per commit made a 54-day run a poll per step.

Reports come from one rank of the last pipeline stage (the one carrying the loss), one per step:
the controller's progress and accounting need no more, and 16,384 ranks' reports per step would
make a 54-day simulation take days.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from checkpointing.manifest import CheckpointError, Manifest, apply_retention, commit, step_prefix
from checkpointing.peer import HeldColumns, Holdings
from checkpointing.schedule import CheckpointInterval
from checkpointing.store import MemoryStore
from controller.attempt import AttemptSpec, GroupStatus, PollResult
from controller.events import EventKind
from controller.placement import rank_index, ranks_on
from controller.sim.model import CostModel, Incident
from controller.sim.replicas import SimReplicas
from health.straggler import StragglerConfig
from trainer.config import state_fingerprint
from trainer.report import StepReport

CHUNK_STEPS = 2000
"""At most this many steps per poll (the controller absorbs them as one batch of reports)."""
_JUDGE = StragglerConfig()


def judged_steps(straggler_steps: int = _JUDGE.consecutive) -> int:
    """Steps of every rank's samples after a rank turns slow: enough for the tracker's window to fill
    with the slow samples and its verdict to hold `straggler_steps` evaluations, with two to spare."""
    return _JUDGE.warmup_steps + _JUDGE.window + straggler_steps + 2


JUDGED_STEPS = judged_steps()
"""At the default health.straggler_steps."""
COMPUTE_SHARE = 0.9
"""Of a step, the compute (the rest is waiting in collectives): what reports carry as compute_s."""
COMPUTE_NOISE = 0.02
"""Relative spread (one standard deviation) of a healthy rank's compute time around its stage's."""
HANG_POLL_S = 5.0
"""How often a stopped group is polled (as the service polls a live one: its silence is evidence)."""


@dataclass
class _Signal:
    at: float
    dead_nodes: set[str] = field(default_factory=set)
    dead_ranks: set[int] = field(default_factory=set)
    on_live_nodes: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)
    events: list[tuple[int, str, dict]] = field(default_factory=list)


class SimWorkerGroup(SimReplicas):
    def __init__(self, clock: Callable[[], float], cost: CostModel, store: MemoryStore, *, total_steps: int,
                 slow_nodes: Callable[[float], dict[str, float]] | None = None,
                 judged_steps: int = JUDGED_STEPS) -> None:
        self.clock = clock
        self.cost = cost
        self.store = store
        self.total_steps = total_steps
        self.judged_steps = judged_steps
        """Steps sampled after a rank turns slow (`judged_steps(health.straggler_steps)`)."""
        self.slow_nodes = slow_nodes or (lambda t: {})
        self.attempt: AttemptSpec | None = None
        self.running = False
        self.started = 0
        """Committed steps still in the store, oldest first."""
        self.wake_at_step: int | None = None
        """Poll right after this step (the driver sets it to the next drill's step)."""
        self.commits_from = -math.inf
        """Poll at every commit due from this time on (the driver sets it: -inf while the controller may
        act on any commit, the time a node is next back while only that can change what it would do, inf
        while it cannot act on one: nothing to grow back into, no straggler to replace, no drill to report
        on). The commits skipped are heard at the next poll, as a real controller hears steps and commits
        late when it polls rarely."""
        self.full_world: int | None = None
        """World size of the first attempt: a smaller mesh keeps the global batch, so its steps are longer."""
        self.snapshot: tuple[AttemptSpec, int, float, float] | None = None
        """The newest peer snapshot: (its attempt, step, taken at, on the buddies at)."""
        self.memory_lost: dict[str, float] = {}
        """node -> when it last lost its host memory (a GPU or host failure)."""
        self.judging: tuple[int, dict[int, float]] | None = None
        """(steps left, {slow rank: factor}): every rank's compute is sampled while steps are left."""
        self.slow_ranks: dict[int, float] = {}
        """This attempt's ranks slowed by a slow-rank drill (its process stays slow until replaced)."""
        self.out: set[int] = set()
        """failure_domain replica: the attempt's data-parallel replicas not training now."""
        self.forming: list[tuple[float, tuple[int, ...]]] = []
        """(ready at, replicas): replicas being formed again, ready to receive their state at that time."""
        self.committed = 0
        """Commits reported so far (the driver notes what the controller saw when it heard one)."""
        self._layout: tuple[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] | None = None
        """The last copies' layout (each copy's node code and rank) and what it was made from: a swap
        keeps the node codes and the buddies, so attempt after attempt lays its copies out the same."""

    # -- the WorkerGroup protocol ------------------------------------------------------------------------
    def start(self, attempt: AttemptSpec) -> None:
        now = self.clock()
        self.attempt = attempt
        self.running = True
        self.started += 1
        self.step = attempt.start_step
        restore = (self.cost.peer_restore_s if attempt.peer_restore is not None
                   else self.cost.restore_s if attempt.resume_step is not None else 0.0)
        self.next_start = now + self.cost.restart_s + restore
        self.stop_at: float | None = None
        self.signals: list[_Signal] = []
        self.commits: list[tuple[float, int]] = []
        self.interval = CheckpointInterval(attempt.checkpoint_every, auto=attempt.checkpoint_auto,
                                           mtbf_s=attempt.mtbf_s)
        self.nodes = attempt.placement.rack_of_node  # the nodes it uses, as keys (not a copy, not a scan of the ranks)
        self.loss_rank = attempt.config.mesh.world_size - 1
        self.axes = attempt.config.mesh.axes()  # (each commit's manifest names them: made once per attempt)
        self.full_world = self.full_world or attempt.config.mesh.world_size
        self.pending_events: list[tuple[int, str, dict]] = []
        self._held: list[StepReport] = []
        """Steps that ended before an incident struck, for the next poll."""
        if restore > 0:  # as the ranks report their load (the slowest's seconds split restart from restore)
            source, step = (("peer", attempt.peer_restore.step) if attempt.peer_restore is not None
                            else ("store", attempt.resume_step))
            self.pending_events.append((0, EventKind.RESTORED, {"source": source, "step": step, "seconds": restore}))
        self._held_compute: list[tuple[int, Any]] = []
        self.slow_ranks = {}
        self.judging = None
        self.out, self.forming = set(), []
        self._judge(now)

    def poll(self) -> PollResult:
        now = self.clock()
        result = PollResult(GroupStatus.RUNNING)
        if not self.running or self.attempt is None:
            return result
        self._steps(now, result)
        for due, step in [c for c in self.commits if c[0] <= now]:
            self.commits.remove((due, step))
            if self.stop_at is None or due <= self.stop_at:
                self._commit(due, step, result)
        result.events.extend(self.pending_events)
        self.pending_events = []
        for signal in [s for s in self.signals if s.at <= now]:
            self.signals.remove(signal)
            result.status = GroupStatus.FAILED if (signal.dead_nodes or signal.dead_ranks or signal.errors) \
                else result.status
            result.dead_nodes |= signal.dead_nodes
            result.dead_ranks |= signal.dead_ranks
            result.on_live_nodes |= signal.on_live_nodes
            result.errors.update(signal.errors)
            result.events.extend(signal.events)
        if self.step >= self.total_steps and not self.commits and self.stop_at is None:
            result.status = GroupStatus.FINISHED
        return result

    def shutdown(self) -> None:
        self.running = False

    def peer_copies(self, peer_key: str, nodes: set[str]) -> Holdings:
        """What `nodes` hold now of the newest peer snapshot, as each would report it (`Held`), in
        columns: a recovery at 131,072 ranks asks for 262,144 copies on 16,384 nodes."""
        if self.snapshot is None:
            return Holdings(())
        attempt, step, taken, on_buddies = self.snapshot
        struck = self.stop_at if self.stop_at is not None else self.clock()
        # Torn buddy copies: a failure while they were being rewritten. A drill lands on a step's end
        # (`taken`) and counts as after the copy: a real controller injects it only once it has heard
        # the step's report, which a rank sends after its snapshot.
        rewriting = taken < struck < on_buddies
        names, keeper, ranks = self._copies(attempt, own_only=rewriting)
        mesh = attempt.config.mesh
        a, world, cursor = attempt.attempt, mesh.world_size, step * attempt.config.train.global_batch
        axes, identity = mesh.axes(), state_fingerprint(attempt.config.model)
        if attempt.failure_domain == "replica":  # each replica's copies, named and laid out as its own world's
            world //= mesh.dp_replicas
            axes = {**axes, "dp": mesh.dp // mesh.dp_replicas}
        answers = np.fromiter(map(nodes.__contains__, names), dtype=bool, count=len(names))
        wiped = {n for n, at in self.memory_lost.items() if at >= taken}  # (a few: those lost since the snapshot)
        for gone in wiped.intersection(names):  # (found in C: 16,384 names)
            answers[names.index(gone)] = False
        answers = answers[keeper]
        return Holdings([HeldColumns(a, step, cursor, world, axes, identity, names, keeper[answers], ranks[answers])])

    def _copies(self, attempt: AttemptSpec, *, own_only: bool) -> tuple[list[str], np.ndarray, np.ndarray]:
        """The copies kept under `attempt`'s snapshots, as (node names, each copy's node, its rank): every
        rank's own on its node, and (unless `own_only`) a second on its buddy's."""
        placement, buddy = attempt.placement, attempt.peer_buddy
        names, node = placement.node_codes
        world = len(node)
        replicas = attempt.failure_domain == "replica"
        per = world // attempt.config.mesh.dp_replicas if replicas else world
        keeper_rank = None
        if buddy and buddy is placement.peer_buddies(replicas=replicas):  # the placement's, as launch gives them
            keeper_rank = placement.peer_keepers(replicas=replicas)
        elif buddy:  # a buddy is a local rank of its replica
            keeper_rank = np.fromiter(buddy, dtype=np.int64, count=world) + np.arange(world) // per * per
        made_of = (node, keeper_rank, per, own_only)  # (the arrays by identity: a swap hands on the same ones)
        last = self._layout
        if last is None or last[0][0] is not node or last[0][1] is not keeper_rank or last[0][2:] != made_of[2:]:
            ranks = np.arange(world) % per  # (a replica's ranks are its local ranks)
            if own_only or keeper_rank is None:
                last = self._layout = made_of, (node, ranks)
            else:
                last = self._layout = made_of, (np.concatenate([node, node[keeper_rank]]), np.concatenate([ranks, ranks]))
        return names, *last[1]

    # -- what the simulation does to it --------------------------------------------------------------------
    def strike(self, incident: Incident, *, rank: int | None = None, factor: float | None = None,
               delay_s: float | None = None) -> bool:
        """An incident at its time (a drill names its rank, a slow-rank drill its factor, a late
        collective its delay); True when it interrupts this attempt."""
        if not self.running or self.attempt is None or self.stop_at is not None:
            return False
        t = incident.time
        kind = incident.component
        on_mesh = rank is not None or incident.node in self.nodes
        if (kind in ("sdc", "straggler", "rank", "hang") or incident.lost_node) and not on_mesh:
            return False
        node_of_rank = self.attempt.placement.node_of_rank
        # The first rank on the struck node (131,072 ranks: from the placement's index, only where it is named)
        first = rank if rank is not None else rank_index(node_of_rank).get(incident.node)[0] if on_mesh else None
        if kind == "straggler":  # slower steps from now on; nothing stops, the judgement looks
            self._steps(t, None)  # the steps that finished before it were not slow
            if rank is not None:
                self.slow_ranks[rank] = factor or 1.0
            self._judge(t, struck=incident.node)
            return False
        if kind == "storage-outage":
            return False
        self._steps(t, None)  # the steps that finished before it
        if kind == "collective":  # a collective between replicas failed, nothing lost (collective-fault)
            return self._resync(t, first, delay_s)
        if kind == "rank":  # its actor sees it die at once; the node is alive
            self.stop_at = t
            assert first is not None
            self.signals.append(_Signal(at=t, dead_ranks={first}, on_live_nodes={first}))
            return True
        if kind == "hang":  # nothing is reported: the controller's hang verdict has to find it
            self.stop_at = t
            return True
        if kind in ("gpu", "host", "network", "software", "storage") and self._replica_domain():
            # The replicas of the node it strikes stop (network and software faults strike the run
            # wherever it is: a node of the mesh drawn from the incident's node name).
            node = incident.node if on_mesh else node_of_rank[zlib.crc32(incident.node.encode()) % len(node_of_rank)]
            replicas = self._replicas_on(node)
            lost_node = incident.lost_node
            if replicas <= self.out:  # only replicas already out: nothing more stops
                if lost_node:
                    self.memory_lost[node] = t
                return False
            if len(self.out | replicas) < self.attempt.config.mesh.dp_replicas:
                self.stop_at = t  # the survivors' step in flight is discarded; they wait for the controller
                ranks = ranks_on(node_of_rank, (node,))
                if lost_node:  # loud: the survivors' collectives fail at once and the probe confirms the
                    # node; silent: they wait in them until its heartbeat times out
                    self.memory_lost[node] = t
                    detection = self.cost.silent_detection_s if incident.silent else self.cost.replica_detection_s
                    self.signals.append(_Signal(at=t + detection, dead_nodes={node}))
                elif incident.timed_out:  # a silent peer that still beats: the survivors' collectives time out
                    what = ("RuntimeError: simulated NIC fault: this node's links are down" if kind == "network"
                            else "RuntimeError: simulated hang: this node's ranks stopped in a collective")
                    self.signals.append(_Signal(at=t + self.cost.collective_timeout_s,
                                                errors={r: what for r in ranks}))
                else:  # a rank's process raised: its sockets close, the survivors' collectives fail at once
                    what = "OSError: [Errno 5] Input/output error" if kind == "storage" else "RuntimeError: simulated bug"
                    self.signals.append(_Signal(at=t, errors={ranks[0]: what}))
                return True
        if incident.lost_node:
            self.memory_lost[incident.node] = t
            self.stop_at = t
            detection = self.cost.silent_detection_s if incident.silent else self.cost.node_loss_detection_s
            self.signals.append(_Signal(at=t + detection, dead_nodes={incident.node}))
        elif incident.timed_out:
            self.stop_at = t
            world = self.attempt.config.mesh.world_size
            what = "network fault" if kind == "network" else "hung rank"
            errors = {r: f"NCCL watchdog: collective operation timed out (simulated {what})"
                      for r in range(min(world, 8))}
            self.signals.append(_Signal(at=t + self.cost.collective_timeout_s, errors=errors))
        elif kind in ("software", "storage"):
            self.stop_at = t
            rank = first if first is not None else 0
            what = "OSError: [Errno 5] Input/output error" if kind == "storage" else "RuntimeError: simulated bug"
            self.signals.append(_Signal(at=t, errors={rank: what}))
        elif kind == "sdc":
            # The probes compare before the next update: caught at the end of the step in flight. A
            # bitflip drill flips a bit at rest, which a replica's probes find before its gradient
            # meets the others' (trainer/probes.py): contained to that replica under failure_domain
            # replica. Corruption in compute (the failure model's) may have reached every replica
            # since the last self-test: the world goes back.
            clean = self.step
            caught = max(t, self.next_start) + self.cost.step_s
            self.stop_at = caught
            assert first is not None
            contained = (rank is not None and self._replica_domain()
                         and len(self.out | self._replicas_on(incident.node)) < self.attempt.config.mesh.dp_replicas)
            self.signals.append(_Signal(at=caught, events=[(first, EventKind.SDC_SUSPECT, {
                "ranks": [first], "step": clean + 1, "clean_through_step": clean, "check": "anomaly",
                "evidence": {"simulated": True}, "contained": contained})]))
        return True

    def _resync(self, t: float, rank: int | None, delay_s: float | None) -> bool:
        """Every live replica discards its step in flight at the failed gradient reduce (the step's
        end; a collective late past the timeout: the others' wait times out); the controller hears of
        it and publishes an epoch of the same members (trainer/protocol.Roster.resolve_discard), which
        they form before they do the step again. A collective late by less than the timeout only
        makes its step that much longer. Nothing stops: False."""
        assert self.attempt is not None
        if not self._replica_domain():
            return False  # (refused at request: the world has no collectives between replicas)
        reduce_at = max(t, self.next_start) + self._step_s(self.next_start)
        if delay_s is not None and delay_s < self.cost.collective_timeout_s:
            self.next_start += delay_s
            return False
        discarded_at = reduce_at + (self.cost.collective_timeout_s if delay_s is not None else 0.0)
        live = self.attempt.config.mesh.dp_replicas - len(self.out)
        resync_at = discarded_at + self.cost.replica_detection_s
        self.next_start = resync_at + self.cost.regroup_s(live)
        step = self.step + 1
        self.signals.append(_Signal(at=discarded_at, events=[
            (rank if rank is not None else 0, EventKind.REPLICA_STEP_DISCARDED, {"step": step, "simulated": True})]))
        self.signals.append(_Signal(at=resync_at, events=[(-1, EventKind.REPLICA_RESYNC, {"step": step})]))
        return False

    def next_wake(self, now: float) -> float:
        """When a poll next has something to say."""
        last = self.step >= self.total_steps  # (the run ends when its final save commits: that is heard)
        times = [s.at for s in self.signals] + [f[0] for f in self.forming if f[0] > now]
        times += [due for due, _ in self.commits if due >= self.commits_from or last]
        if self.running and self.stop_at is None and not last:
            step_s = self._step_s(self.next_start)
            chunk = min(CHUNK_STEPS, self.total_steps - self.step)
            if self.wake_at_step is not None and self.wake_at_step > self.step:
                chunk = min(chunk, self.wake_at_step - self.step)  # a drill waits for this step
            if self.judging is not None:
                chunk = min(chunk, self.judging[0])  # the judgement's verdict at its time, not the next commit's
            if self.attempt is not None and self.attempt.checkpoint_uri is not None and self.commits_from < math.inf:
                # the first save to commit from `commits_from` on: the controller may act on it (grow back,
                # replace a straggler). Later saves' stalls are left out: a wake too early finds no commit
                # and the next one is planned from there.
                lag = self.cost.checkpoint_stall_s + self.cost.checkpoint_save_s
                steps = max(1, math.ceil((self.commits_from - lag - self.next_start) / step_s)) \
                    if self.commits_from > -math.inf else 1
                save = min(math.ceil((self.step + steps) / self.interval.every) * self.interval.every, self.total_steps)
                times.append(self.next_start + (save - self.step) * step_s + lag)
            times.append(self.next_start + chunk * step_s)
            for ready, _ in self.forming:  # the step boundary a formed replica joins at: steps get faster there
                times.append(self.next_start + max(1, math.ceil((ready - self.next_start) / step_s)) * step_s)
        if self.running and self.stop_at is not None:
            times.append(now + HANG_POLL_S)  # stopped: the controller's own hang verdict may come first
        return max(min(times), now + 1e-6) if times else math.inf

    # -- internals --------------------------------------------------------------------------------------
    def _step_s(self, at: float) -> float:
        """A step's time now: the cost model's, longer on a shrunk mesh (same global batch on fewer GPUs)
        and on a straggling node's or rank's mesh (everyone waits for the slowest)."""
        slow = self.slow_nodes(at)
        factor = max([f for n, f in slow.items() if n in self.nodes] + list(self.slow_ranks.values()), default=1.0)
        return self._healthy_step_s() * factor

    def _healthy_step_s(self) -> float:
        assert self.attempt is not None
        mesh = self.attempt.config.mesh
        world = mesh.world_size
        step = self.cost.step_s * (self.full_world or world) / world
        if self.out and self.attempt.batch_while_healing == "keep":  # the live replicas take the others' samples
            step *= mesh.dp_replicas / (mesh.dp_replicas - len(self.out))
        return step

    def _judge(self, at: float, *, struck: str | None = None) -> None:
        """Sample every rank for the next `judged_steps` steps if a rank of this mesh is slow at `at`."""
        assert self.attempt is not None
        slow = {n: f for n, f in self.slow_nodes(at).items() if n in self.nodes}
        if struck is not None and struck not in slow and not self.slow_ranks:
            return  # a straggler elsewhere: nothing here to judge
        if not slow and not self.slow_ranks:
            return
        factors = dict(self.slow_ranks)
        node_of_rank = self.attempt.placement.node_of_rank
        for r in ranks_on(node_of_rank, slow):  # (a search per slow node, not a pass over 131,072 ranks)
            factors[r] = max(factors.get(r, 1.0), slow[node_of_rank[r]])
        self.judging = (self.judged_steps, factors)

    def _compute(self, step: int) -> Any:
        """Every rank's compute seconds of `step` while judging (deterministic for the attempt and step)."""
        assert self.attempt is not None and self.judging is not None
        left, factors = self.judging
        self.judging = (left - 1, factors) if left > 1 else None
        world = self.attempt.config.mesh.world_size
        rng = np.random.default_rng([self.attempt.attempt, step])
        compute = self._healthy_step_s() * COMPUTE_SHARE * (1.0 + COMPUTE_NOISE * rng.standard_normal(world))
        for rank, factor in factors.items():
            compute[rank] *= factor
        return compute

    def _steps(self, until: float, result: PollResult | None) -> None:
        assert self.attempt is not None
        a = self.attempt
        limit = until if self.stop_at is None else min(until, self.stop_at)
        step_s = self._step_s(self.next_start)
        tokens = a.config.train.global_batch * a.config.model.seq_len
        while self.step < self.total_steps:
            end = self.next_start + step_s
            if end > limit:
                break
            self.step += 1
            a = self.attempt  # (formed replicas move it to a new placement)
            snapshot = bool(a.peer_every) and self.step % a.peer_every == 0
            # A snapshot first waits for the last one's transfer to the buddies (trainer/peer.py): a
            # transfer longer than the steps between snapshots stalls the loop for the rest of it.
            stall = 0.0
            if snapshot:
                last = self.snapshot if self.snapshot is not None and self.snapshot[0] is a else None
                stall = self.cost.peer_snapshot_stall_s + (max(0.0, last[3] - end) if last is not None else 0.0)
            report = StepReport(rank=self.loss_rank, attempt=a.attempt, step=self.step,
                                cursor=self.step * a.config.train.global_batch,
                                loss=2.0 + 8.0 / math.sqrt(self.step), step_time_s=step_s, data_s=0.0,
                                compute_s=step_s * COMPUTE_SHARE, wait_s=step_s * (1 - COMPUTE_SHARE),
                                tokens_per_s=tokens * self._batch_share() / step_s,
                                end_time=end, snapshot_s=stall)
            sampled = [(self.step, self._compute(self.step))] if self.judging is not None else []
            if result is not None:
                result.reports.append(report)
                result.compute += sampled
            else:
                self._held.append(report)
                self._held_compute += sampled
            self.next_start = end
            if snapshot:
                self.next_start += stall
                self.snapshot = (a, self.step, end, end + stall + self.cost.peer_transfer_s)
            if a.checkpoint_uri is not None and self.interval.due(self.step, self.total_steps):
                self.next_start += self.cost.checkpoint_stall_s
                self.commits.append((end + self.cost.checkpoint_stall_s + self.cost.checkpoint_save_s, self.step))
                self.pending_events.append((0, EventKind.CHECKPOINT_STAGED, {"step": self.step,
                                                                     "blocked_s": self.cost.checkpoint_stall_s}))
                chosen = self.interval.measured(self.cost.checkpoint_stall_s, step_s)
                if chosen is not None:
                    self.pending_events.append((0, EventKind.CHECKPOINT_INTERVAL, chosen))
            if self.forming and (rejoin := self._rejoin(self.next_start)) > 0:
                self.next_start += rejoin
                step_s = self._step_s(self.next_start)
        if result is not None and self._held:
            result.reports[:0] = self._held
            self._held = []
        if result is not None and self._held_compute:
            result.compute[:0] = self._held_compute
            self._held_compute = []

    def _commit(self, at: float, step: int, result: PollResult) -> None:
        assert self.attempt is not None
        a = self.attempt
        mesh = a.config.mesh
        # The trainer's commit and retention (the simulated shards have no files).
        try:
            commit(self.store, Manifest(run_id=a.run_id, step=step, attempt=a.attempt, mesh=self.axes,
                                        world_size=mesh.world_size, cursor=step * a.config.train.global_batch,
                                        seeds={}, created_at=at))
        except CheckpointError:  # already committed by an earlier attempt: nothing new
            return
        removed = apply_retention(self.store, a.run_id, a.checkpoint_keep)
        self.committed += 1
        result.events.append((0, EventKind.CHECKPOINT_COMMITTED, {
            "step": step, "uri": f"{self.store.uri}/{step_prefix(a.run_id, step)}", "bytes": 0,
            "seconds": self.cost.checkpoint_stall_s + self.cost.checkpoint_save_s, "removed": removed}))
