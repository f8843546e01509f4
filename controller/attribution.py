"""Who caused a failure. Pure.

When one rank dies its ring neighbours fail within milliseconds with collective errors; those are
symptoms. The cause is, in order: a dead node (Ray marked it dead), a dead rank (its process died), a
rank that stopped answering (hung), a rank whose own code raised, and only then the collectives.
Actor deaths are held for a short grace period because a node's death is noticed a moment after
its actors' deaths, and replacing a node is a different decision from restarting a rank. A training
process that died under a live actor needs no grace: the actor's answer proves its node alive.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from controller.attempt import PollResult
from controller.events import EventKind
from controller.failure_policy import FailureCause, FailureEvent
from controller.placement import ranks_on
from controller.progress import RunProgress
from health.hang import hang_verdict
from health.straggler import RankScore, StragglerConfig, StragglerTracker
from trainer.config import MeshShape

ATTRIBUTION_GRACE_S = 3.0
NODE_SUSPECT_GRACE_S = 20.0
"""When every rank of a node died at once the node itself is suspect: wait this long for Ray to
declare it dead (its default health checks take ~13 s) before treating it as rank deaths."""
_SYMPTOM = re.compile(
    r"gloo|nccl|DistBackendError|Connection closed|Connection reset|connection reset|Broken pipe|"
    r"timed out|Timed out|timeout|ECONNRESET|peer|Socket", re.IGNORECASE)


def is_collective_symptom(message: str) -> bool:
    """Whether a rank's error says a collective failed under it. Only the exception lines count, not a
    traceback's frames (indented: file paths such as trainer/peer.py, code such as `timeout=...`)."""
    return any(_SYMPTOM.search(line) for line in message.splitlines() if line and not line[0].isspace())


def attribute(now: float, *, errors: dict[int, str], dead_nodes: set[str], dead_ranks: set[int],
              unresponsive: set[int], node_of_rank: tuple[str, ...], signal_age_s: float | None,
              on_live_nodes: frozenset[int] | set[int] = frozenset(),
              suspect_nodes: frozenset[str] | set[str] = frozenset(),
              silent: Mapping[str, str] | None = None) -> FailureEvent | None:
    """The failure's cause, or None while it is too early to tell (or nothing failed).
    `signal_age_s`: time since the first failure signal of the attempt. `on_live_nodes`: dead ranks
    whose node is known to be alive (their actor said so): no grace is needed to rule out a node loss.
    `suspect_nodes`: nodes not declared dead whose node daemon is gone (PollResult.suspect_nodes).
    A node every rank of which died and whose daemon is gone is lost now: the data plane and the
    probe agree, and Ray's own health checks (~30 s by default) need not be waited for. `silent`: nodes
    of `dead_nodes` lost silently (their heartbeat stopped, confirmed: PollResult.silent_nodes), with
    what was seen."""
    whole = _dying_nodes(dead_ranks - set(on_live_nodes), node_of_rank)
    lost = set(dead_nodes) | (whole & set(suspect_nodes))
    if lost:
        dying = whole | set(suspect_nodes)
        if dying - lost and signal_age_s is not None and signal_age_s < NODE_SUSPECT_GRACE_S:
            # Another node's ranks all died with it, or its daemon is gone: Ray declares nodes dead
            # one by one, a moment apart. One decision for all of them.
            return None
        ranks = tuple(ranks_on(node_of_rank, lost))
        dark = {node: why for node, why in (silent or {}).items() if node in lost}
        how = "".join(f"; {node} went silent: {why}" for node, why in sorted(dark.items()))
        return FailureEvent(time=now, cause=FailureCause.NODE_LOST, nodes=tuple(sorted(lost)), ranks=ranks,
                            message=f"node(s) {sorted(lost)} lost with ranks {list(ranks)}{how}",
                            evidence={"silent": dark} if dark else {})
    if dead_ranks and dead_ranks <= on_live_nodes:
        return _rank_died(now, dead_ranks, node_of_rank)
    if not (errors or dead_ranks) or signal_age_s is None or signal_age_s < ATTRIBUTION_GRACE_S:
        return None
    if dead_ranks and signal_age_s < NODE_SUSPECT_GRACE_S and _whole_node_died(dead_ranks, node_of_rank):
        return None
    if dead_ranks:
        return _rank_died(now, dead_ranks, node_of_rank)
    if unresponsive:
        ranks = tuple(sorted(unresponsive))
        return FailureEvent(time=now, cause=FailureCause.HANG, ranks=ranks,
                            message=f"rank(s) {list(ranks)} stopped answering; the others' collectives timed out")
    own = {r: m for r, m in errors.items() if not is_collective_symptom(m)}
    if own:
        return FailureEvent(time=now, cause=FailureCause.WORKER_ERROR, ranks=tuple(sorted(own)),
                            message="; ".join(f"rank {r}: {m.strip().splitlines()[-1]}" for r, m in sorted(own.items())),
                            evidence={"errors": {str(r): m for r, m in sorted(own.items())}})
    return FailureEvent(time=now, cause=FailureCause.COLLECTIVE_ERROR, ranks=tuple(sorted(errors)),
                        message=f"collective errors on ranks {sorted(errors)} with no other cause found")


def _dying_nodes(dead_ranks: set[int], node_of_rank: tuple[str, ...]) -> set[str]:
    """Nodes every rank of which died."""
    return {node for node in {node_of_rank[r] for r in dead_ranks}
            if all(r in dead_ranks for r in ranks_on(node_of_rank, (node,)))}


def _whole_node_died(dead_ranks: set[int], node_of_rank: tuple[str, ...]) -> bool:
    return bool(_dying_nodes(dead_ranks, node_of_rank))


def _rank_died(now: float, dead_ranks: set[int], node_of_rank: tuple[str, ...]) -> FailureEvent:
    ranks = tuple(sorted(dead_ranks))
    nodes = sorted({node_of_rank[r] for r in ranks})
    return FailureEvent(time=now, cause=FailureCause.RANK_DIED, ranks=ranks,
                        message=f"rank(s) {list(ranks)} died on {nodes}; their nodes are alive")


HANG_WINDOW = 20
"""Step times the hang threshold takes its median of (health.hang)."""


class AttemptSignals:
    """What one attempt has shown so far that may end it: rank errors and deaths since the first
    sign of trouble, and each rank's progress (for a hang verdict when nothing else is wrong)."""

    def __init__(self) -> None:
        self.errors: dict[int, str] = {}
        self.dead_ranks: set[int] = set()
        self.on_live_nodes: set[int] = set()
        self.since: float | None = None
        """When the first failure signal of the attempt came (None: none yet)."""
        self.last_step: dict[int, int] = {}
        self.last_report_at: dict[int, float] = {}
        self.step_times: deque[float] = deque(maxlen=HANG_WINDOW)
        """The newest step times of this attempt (the hang threshold's median)."""
        self.steps = 0
        """Steps the attempt has completed."""

    def heard(self, rank: int, step: int, now: float) -> None:
        """A rank reported finishing `step`."""
        self.last_step[rank] = step
        self.last_report_at[rank] = now

    def stepped(self, step_time_s: float) -> None:
        """The attempt completed one more step (every rank has reported it)."""
        self.step_times.append(step_time_s)
        self.steps += 1

    def failure(self, now: float, result: PollResult, node_of_rank: tuple[str, ...], *, hang_factor: float,
                hang_floor_s: float) -> FailureEvent | None:
        """Fold a poll's failure signals in; the attempt's failure once it can be attributed, or a hang
        when no rank has made progress for too long with nothing else wrong."""
        self.errors.update(result.errors)
        self.dead_ranks |= result.dead_ranks
        self.on_live_nodes |= result.on_live_nodes
        if (self.errors or self.dead_ranks or result.dead_nodes) and self.since is None:
            self.since = now
        age = None if self.since is None else now - self.since
        failure = attribute(now, errors=self.errors, dead_nodes=result.dead_nodes, dead_ranks=self.dead_ranks,
                            unresponsive=result.unresponsive, node_of_rank=node_of_rank, signal_age_s=age,
                            on_live_nodes=self.on_live_nodes, suspect_nodes=result.suspect_nodes,
                            silent=result.silent_nodes)
        if failure is not None or self.since is not None or not self.step_times:
            return failure
        verdict = hang_verdict(now, last_step=self.last_step, last_report_at=self.last_report_at,
                               recent_step_times=list(self.step_times), factor=hang_factor, floor_s=hang_floor_s)
        if verdict is None:
            return None
        ranks = tuple(sorted(result.unresponsive)) or verdict.ranks
        return FailureEvent(time=now, cause=FailureCause.HANG, ranks=ranks,
                            message=f"no progress for {verdict.silent_s:.1f} s (limit {verdict.threshold_s:.1f} s)")


def sdc_failure(now: float, detail: dict[str, Any], node_of_rank: tuple[str, ...]) -> tuple[FailureEvent, int]:
    """An `sdc_suspect` event as the failure it is, and the last step the probes vouch for (commits after
    it are discarded: they may hold corrupted state)."""
    ranks = tuple(int(r) for r in detail.get("ranks", []))
    nodes = tuple(sorted({node_of_rank[r] for r in ranks}))
    clean = int(detail.get("clean_through_step", 0))
    return FailureEvent(time=now, cause=FailureCause.SDC, nodes=nodes, ranks=ranks,
                        message=f"silent data corruption suspected on rank(s) {list(ranks)} ({detail.get('check')} "
                                f"check at step {detail.get('step')}); state known clean through step {clean}",
                        evidence=detail.get("evidence") or {}, contained=bool(detail.get("contained"))), clean


def checksums_suspect(detail: dict[str, Any]) -> dict[str, Any]:
    """A `replica_checksums` that says the replicas' final states differ, as the `sdc_suspect` it
    is: the ranks at that position of the replicas outside the majority (every listed one, with no
    majority), not contained (the replica that saved the final step may be one of them), clean
    through the last step the replicas were seen to agree on. The run does not end `succeeded`: it
    goes back there and trains the rest again."""
    from health.sdc import minority

    sums = [int(v) for v in detail.get("checksums", ())]
    ranks = [int(r) for r in detail.get("ranks", ())]
    odd, _ = minority(dict(enumerate(sums)))
    named = [ranks[i] for i in sorted(odd)] if len(ranks) == len(sums) else []
    why = (f"replicas {detail.get('replicas')} end step {detail.get('step')} with different states at shard "
           f"position {detail.get('position')} (checksums {sums})")
    return {"step": detail.get("step"), "check": "replica_checksums", "ranks": named, "contained": False,
            "clean_through_step": int(detail.get("agreed_step", 0)), "evidence": {str(r): [why] for r in named},
            "why": why}


def final_save_failure(now: float, last_step: int, error: str) -> FailureEvent:
    """The workers finished but the last step's checkpoint did not commit: not done until it is saved."""
    return FailureEvent(time=now, cause=FailureCause.FINAL_SAVE_FAILED,
                        message=f"the final checkpoint (step {last_step}) did not commit ({error}); the steps after "
                                "the last committed one run again so the run's final state is saved")


def failures_from(events: list[dict[str, Any]]) -> list[FailureEvent]:
    """The failures a timeline records (a restored run's count against max_failures)."""
    causes = {c.value for c in FailureCause}
    return [FailureEvent(time=e["time"], cause=FailureCause(e["detail"]["cause"]),
                         nodes=tuple(e["detail"].get("nodes") or ()), ranks=tuple(e["detail"].get("ranks") or ()),
                         message=e["detail"].get("message", ""))
            for e in events if e["kind"] == EventKind.FAILURE_DETECTED and e["detail"].get("cause") in causes]


def quarantines_from(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nodes a timeline quarantined for good (not merely lost): {node, reason, evidence, time}."""
    return [{"node": e["detail"]["node"], "reason": e["detail"].get("reason"),
             "evidence": e["detail"].get("evidence") or {}, "time": e["time"]}
            for e in events if e["kind"] == EventKind.QUARANTINED and e["detail"].get("reason") != "lost"]


class MeshStages(Mapping[int, int]):
    """rank -> its pipeline stage, computed from the mesh (an attempt of 131k ranks builds no dict)."""

    def __init__(self, mesh: MeshShape) -> None:
        self.mesh = mesh
        self._world = mesh.world_size
        """(Read for every report a poll folds in: a plain attribute, not the mesh's product.)"""

    def __getitem__(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self._world:
            raise KeyError(rank)
        return self.mesh.stage_of(rank)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < self._world  # (Mapping's would compute the stage)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._world))

    def __len__(self) -> int:
        return self._world

    def ranks(self) -> range:
        """Every rank, in order (the straggler tracker's order)."""
        return range(self.mesh.world_size)

    def stages(self) -> np.ndarray:
        """Every rank's stage, as one array (131,072 of them in a millisecond)."""
        return self.mesh.stage_of(np.arange(self.mesh.world_size))


class StragglerWatch:
    """One attempt's straggler judgement: each rank's compute time against its stage peers'. Verdicts
    become `straggler` events; under `straggler_action: replace` the ranks slower than their peers are
    replaced at the next checkpoint (no step is lost) when a spare can take their place."""

    def __init__(self, mesh: MeshShape, node_of_rank: tuple[str, ...], *, ratio: float, action: str,
                 steps: int = StragglerConfig.consecutive) -> None:
        self.tracker = StragglerTracker(MeshStages(mesh), StragglerConfig(ratio=ratio, consecutive=steps))
        self.node_of_rank = node_of_rank
        self.ratio = ratio
        self.action = action
        self.to_replace: set[int] = set()

    @property
    def scores(self) -> Mapping[int, RankScore]:
        return self.tracker.scores

    def add(self, rank: int, step: int, compute_s: float) -> None:
        self.tracker.add(rank, step, compute_s)

    def add_step(self, step: int, compute_s: Any) -> None:
        self.tracker.add_step(step, compute_s)

    def judge(self) -> list[dict[str, Any]]:
        """The `straggler` event detail of each new verdict (the rank, its node, its score, on what basis)."""
        details: list[dict[str, Any]] = [
            {"rank": v.rank, "node": self.node_of_rank[v.rank], "score": round(v.score, 3), "basis": v.basis,
             "step": v.step, "compute_s": v.compute_s, "ratio": self.ratio, "action": self.action}
            for v in self.tracker.evaluate()]
        if self.action == "replace":
            self.to_replace |= {int(d["rank"]) for d in details if d["basis"] == "relative"}
        return details

    def replacement(self, now: float, *, spare: bool, step: int) -> FailureEvent | None:
        """At a checkpoint, the ranks flagged for replacement that are still stragglers as a `straggler`
        failure, if a spare can take their place (the others are forgotten)."""
        scores = self.tracker.scores
        still = sorted(r for r in self.to_replace if (score := scores.get(r)) is not None and score.straggler)
        self.to_replace = set(still)
        if not still or not spare:
            return None
        nodes = tuple(sorted({self.node_of_rank[r] for r in still}))
        relative = {r: round(scores[r].relative, 3) for r in still}
        return FailureEvent(
            time=now, cause=FailureCause.STRAGGLER, nodes=nodes, ranks=tuple(still),
            message=f"rank(s) {still} on {list(nodes)} compute {relative} x their stage peers' median "
                    f"(straggler_ratio {self.ratio}); replaced at the step-{step} checkpoint")


@dataclass
class Seen:
    """What one poll of an attempt showed, for the controller to record and act on."""

    first_step: int | None = None
    """The attempt's first completed step, when this poll completed it."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """`straggler` event details of the poll's new verdicts."""
    committed: bool = False
    """A checkpoint committed (a boundary where no step is lost)."""
    interval: int | None = None
    """`auto`: the save interval the attempt chose."""
    failure: FailureEvent | None = None
    """The attempt's failure: an SDC the probes caught (their evidence is the cause; the ranks' errors
    that follow are not), else one attributed from the ranks' errors, deaths and silence."""


class AttemptWatch:
    """One attempt as the controller watches it: the signals that may end it, its straggler
    judgement, whether its final save failed, and an SDC's last clean step."""

    def __init__(self, attempt: int, mesh: MeshShape, node_of_rank: tuple[str, ...], *, last_step: int,
                 straggler_ratio: float, straggler_action: str, hang_factor: float, hang_floor_s: float,
                 straggler_steps: int = StragglerConfig.consecutive) -> None:
        self.attempt = attempt
        self.signals = AttemptSignals()
        self.stragglers = StragglerWatch(mesh, node_of_rank, ratio=straggler_ratio, action=straggler_action,
                                         steps=straggler_steps)
        self.node_of_rank = node_of_rank
        self.last_step = last_step
        self.hang_factor, self.hang_floor_s = hang_factor, hang_floor_s
        self.final_save_error: str | None = None
        """Why the last step's save failed (None: it committed, or has not failed)."""
        self.rollback_through: int | None = None
        """SDC: the last step the probes vouch for; newer commits are discarded once the attempt is down."""
        self.rejected: tuple[int, str] | None = None
        """(step, why): the checkpoint the attempt was loading failed a rank's digest check."""
        self.peer_rejected: tuple[int, int, str] | None = None
        """(attempt, step, why): the peer snapshot step the attempt was loading could not be loaded."""

    @property
    def steps(self) -> int:
        """Steps the attempt has completed."""
        return self.signals.steps

    def fold(self, now: float, result: PollResult, progress: RunProgress) -> Seen:
        """Fold one poll in: reports into progress, signals and straggler scores; its events and
        signals into what they mean."""
        seen = Seen()
        for report in result.reports:
            first = not progress.has_stepped(self.attempt)
            self.signals.heard(report.rank, report.step, now)
            self.stragglers.add(report.rank, report.step, report.compute_s)
            if progress.add(report, heard_at=now):
                self.signals.stepped(report.step_time_s)
                if first:
                    seen.first_step = report.step
        for step, compute in result.compute:
            self.stragglers.add_step(step, compute)
        seen.stragglers = self.stragglers.judge()
        suspect = None
        for _, kind, detail in result.events:
            if kind == EventKind.CHECKPOINT_INTERVAL:
                seen.interval = int(detail.get("steps", 0))
            seen.committed = seen.committed or kind == EventKind.CHECKPOINT_COMMITTED
            if kind in (EventKind.CHECKPOINT_FAILED, EventKind.CHECKPOINT_COMMITTED) and detail.get("step") == self.last_step:
                self.final_save_error = detail.get("error", "failed") if kind == EventKind.CHECKPOINT_FAILED else None
            if kind == EventKind.SDC_SUSPECT and suspect is None:
                suspect = detail
            if kind == EventKind.REPLICA_CHECKSUMS and detail.get("agree") is False and suspect is None:
                suspect = checksums_suspect(detail)
            if kind == EventKind.RESTORE_FAILED and "step" in detail:
                why = str(detail.get("error", ""))
                if detail.get("source") == "peer":
                    self.peer_rejected = (int(detail["saved_by_attempt"]), int(detail["step"]), why)
                else:
                    self.rejected = (int(detail["step"]), why)
        if suspect is not None:
            seen.failure, self.rollback_through = sdc_failure(now, suspect, self.node_of_rank)
        else:
            seen.failure = self.signals.failure(now, result, self.node_of_rank, hang_factor=self.hang_factor,
                                                hang_floor_s=self.hang_floor_s)
        return seen

    def contained(self, ranks: set[int]) -> None:
        """A failure that stopped only these ranks' replicas was handled while the others train on:
        its signals are spent, and the ranks are not heard from (nor judged silent) until they rejoin."""
        s = self.signals
        s.errors, s.dead_ranks, s.on_live_nodes, s.since = {}, set(), set(), None
        for rank in ranks:
            s.last_step.pop(rank, None)
            s.last_report_at.pop(rank, None)

    def moved(self, node_of_rank: tuple[str, ...]) -> None:
        """Ranks formed again on other nodes (a replica on a spare)."""
        self.node_of_rank = node_of_rank
        self.stragglers.node_of_rank = node_of_rank

    def finished(self, now: float) -> FailureEvent | None:
        """The workers finished with no sign of trouble: None when done, or the failed final save."""
        if self.final_save_error is None:
            return None
        return final_save_failure(now, self.last_step, self.final_save_error)

    def take_rollback(self) -> int | None:
        through, self.rollback_through = self.rollback_through, None
        return through

    def take_rejected(self) -> tuple[int, str] | None:
        rejected, self.rejected = self.rejected, None
        return rejected

    def take_peer_rejected(self) -> tuple[int, int, str] | None:
        rejected, self.peer_rejected = self.peer_rejected, None
        return rejected


def relaunch_failure(now: float, message: str, node_of_rank: tuple[str, ...], live: set[str]) -> FailureEvent:
    """A relaunch during recovery failed: a node may have died without Ray saying so yet (nodes missing
    from the cluster are lost), else the workers' error is the cause."""
    missing = tuple(sorted(set(node_of_rank) - live))
    return FailureEvent(time=now, cause=FailureCause.NODE_LOST if missing else FailureCause.WORKER_ERROR,
                        nodes=missing, message=f"relaunch failed: {message}")
