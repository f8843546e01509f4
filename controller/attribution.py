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
from typing import Any

from controller.attempt import PollResult
from controller.events import EventKind
from controller.failure_policy import FailureCause, FailureEvent
from health.hang import hang_verdict
from health.straggler import RankScore, StragglerVerdict

ATTRIBUTION_GRACE_S = 3.0
NODE_SUSPECT_GRACE_S = 20.0
"""When every rank of a node died at once the node itself is suspect: wait this long for Ray to
declare it dead (its default health checks take ~13 s) before treating it as rank deaths."""
_SYMPTOM = re.compile(
    r"gloo|nccl|DistBackendError|Connection closed|Connection reset|connection reset|Broken pipe|"
    r"timed out|Timed out|timeout|ECONNRESET|peer|Socket", re.IGNORECASE)


def is_collective_symptom(message: str) -> bool:
    return bool(_SYMPTOM.search(message))


def attribute(now: float, *, errors: dict[int, str], dead_nodes: set[str], dead_ranks: set[int],
              unresponsive: set[int], node_of_rank: tuple[str, ...], signal_age_s: float | None,
              on_live_nodes: frozenset[int] | set[int] = frozenset()) -> FailureEvent | None:
    """The failure's cause, or None while it is too early to tell (or nothing failed).
    `signal_age_s`: time since the first failure signal of the attempt. `on_live_nodes`: dead ranks
    whose node is known to be alive (their actor said so): no grace is needed to rule out a node loss."""
    if dead_nodes:
        ranks = tuple(r for r, n in enumerate(node_of_rank) if n in dead_nodes)
        return FailureEvent(time=now, cause=FailureCause.NODE_LOST, nodes=tuple(sorted(dead_nodes)), ranks=ranks,
                            message=f"node(s) {sorted(dead_nodes)} lost with ranks {list(ranks)}")
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
                            message="; ".join(f"rank {r}: {m.strip().splitlines()[-1]}" for r, m in sorted(own.items())))
    return FailureEvent(time=now, cause=FailureCause.COLLECTIVE_ERROR, ranks=tuple(sorted(errors)),
                        message=f"collective errors on ranks {sorted(errors)} with no other cause found")


def _whole_node_died(dead_ranks: set[int], node_of_rank: tuple[str, ...]) -> bool:
    for node in {node_of_rank[r] for r in dead_ranks}:
        if all(r in dead_ranks for r, n in enumerate(node_of_rank) if n == node):
            return True
    return False


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
                            on_live_nodes=self.on_live_nodes)
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
                        evidence=detail.get("evidence") or {}), clean


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


def straggler_events(verdicts: list[StragglerVerdict], node_of_rank: tuple[str, ...], *, ratio: float,
                     action: str) -> list[dict[str, Any]]:
    """The `straggler` event detail of each verdict (the rank, its node, its score and on what basis)."""
    return [{"rank": v.rank, "node": node_of_rank[v.rank], "score": round(v.score, 3), "basis": v.basis, "step": v.step,
             "compute_s": v.compute_s, "ratio": ratio, "action": action} for v in verdicts]


def straggler_replacement(now: float, candidates: set[int], scores: dict[int, RankScore],
                          node_of_rank: tuple[str, ...], *, spare: bool, ratio: float, step: int
                          ) -> tuple[FailureEvent | None, set[int]]:
    """At a checkpoint (no step is lost), the ranks flagged for replacement that are still stragglers
    become a `straggler` failure, if a spare can take their place; (the failure or None, the ranks still
    to replace)."""
    still = sorted(r for r in candidates if (score := scores.get(r)) is not None and score.straggler)
    if not still or not spare:
        return None, set(still)
    nodes = tuple(sorted({node_of_rank[r] for r in still}))
    relative = {r: round(scores[r].relative, 3) for r in still}
    return FailureEvent(
        time=now, cause=FailureCause.STRAGGLER, nodes=nodes, ranks=tuple(still),
        message=f"rank(s) {still} on {list(nodes)} compute {relative} x their stage peers' median "
                f"(straggler_ratio {ratio}); replaced at the step-{step} checkpoint"), set(still)
