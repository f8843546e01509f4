"""Goodput accounting: where a run's wall time went, from its event timeline and its step spans. Pure.

Wall time (submission to end, or to now) is cut into elementary segments, each given exactly one
category, so productive time plus the badput categories add up to wall time (to float precision):

- productive            steps whose progress was kept (the last execution of each step number),
                        less their straggler excess
- queueing              submitted -> first attempt started (pending, planning)
- startup               first attempt started -> its first step began
- checkpoint_stall      the training loop between a step and the next when a save began after it,
                        and a succeeded run's wait for its final checkpoint
- failure_detection     the failure (a drill's injection, else the attempt's last finished step) ->
                        `failure_detected`
- restart_restore       `failure_detected` -> the next attempt's first step (new mesh, launch, load);
                        for a failure that stopped only some replicas, -> the survivors' next step
                        (their cross-replica regroup), and the survivors' stall while the formed
                        replicas receive their state (`replica_rejoined` seconds)
                        A drain (`drained`: the ranks stopped at a step boundary for nodes that
                        must go) charges its stopped step's keeping to checkpoint_stall and the
                        reseat up to the next attempt's first step to restart_restore; nothing
                        is recomputed
- recomputation         steps whose progress was lost (done again after a rollback), and the step in
                        flight when a failure struck
                        A step discarded with no replica lost (`replica_step_discarded`, then
                        the controller's `replica_resync` epoch) charges the step in flight to
                        recomputation, the wait for the epoch to failure_detection, and its forming
                        to restart_restore
- straggler_slowdown    in kept steps after a `straggler` verdict: the time above the attempt's
                        median step before it
- degraded_capacity     the share of kept steps' time (straggler excess aside) that did not train
                        the planned mesh's share of the batch, in two parts (`degraded_s`):
                        smaller_mesh: an attempt on a mesh smaller than the planned one (shrunk for
                        want of nodes) trains at its throughput against the planned mesh, the planned
                        mesh's median step over its own (the global batch is the same), at most 1;
                        with no step measured on the planned mesh, its share of the planned mesh's
                        ranks (ideal scaling). The rest of its steps' time is degraded.
                        replicas_out: a step begun while k of the attempt's D data-parallel replicas
                        were out (`replica_lost` -> `replica_rejoined`, failure_domain replica) trains
                        (D-k)/D of what it would have: k/D of its time is degraded, whether the live
                        replicas kept the batch (a step D/(D-k) as long: the excess is k/D of it) or
                        shrank it (as long, k/D of the batch missing). Each of the k replicas' 1/D is
                        charged to the failure that took it out, so overlapping failures never charge
                        the same step twice. A step's time is therefore productive * (D-k)/D * the
                        mesh's throughput, and degraded for the rest
- waiting_for_capacity  a `decision` to wait (below min_dp) -> the next attempt started; a run
                        `preempted` for a higher-priority one -> its next attempt started (the
                        stopped step's commit before it is checkpoint_stall)
- other                 everything else (gaps between steps, shutdown)

Events are dicts {time, attempt, kind, detail} (the REST form); spans come from the step reports.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from controller.events import EventKind


CATEGORIES = ("queueing", "startup", "checkpoint_stall", "failure_detection", "restart_restore", "recomputation",
              "straggler_slowdown", "degraded_capacity", "waiting_for_capacity", "other")

# When labelled intervals overlap, the higher priority (lower index) takes the time.
_PRIORITY = ("productive", "recomputation", "failure_detection", "waiting_for_capacity", "restart_restore",
             "startup", "queueing", "checkpoint_stall", "other")


@dataclass(frozen=True)
class StepSpan:
    step: int
    """Step number the execution finished."""
    attempt: int
    """Attempt that ran it."""
    start: float
    """Unix seconds it began (end - its step time)."""
    end: float
    """Unix seconds it finished."""


@dataclass(frozen=True)
class FailureTiming:
    """One failure's latencies: onset (a drill's injection, else the last finished step) -> detected ->
    recovered (the first step of the next attempt began; None while it has not)."""
    attempt: int
    cause: str
    onset: float
    detected_at: float
    recovered_at: float | None
    recomputation_s: float = 0.0
    """Work of the failed attempt that was done again: its steps a later attempt redid, and the step in flight."""
    waiting_s: float = 0.0
    """Of the recovery, the time spent waiting for capacity (below min_dp)."""
    restore_s: float = 0.0
    """Of the recovery, the next attempt's load of the state (its ranks' `restored` seconds, the slowest's):
    the rest, waiting aside, is the restart (processes, communicators, the first step's start)."""
    next_attempt: int | None = None
    """The attempt the recovery started (None while none has)."""
    degraded_s: float = 0.0
    """What running that attempt on a mesh smaller than the planned one cost (its smaller_mesh
    `degraded_capacity`): a shrink's price after the recovery, until the next failure or grow; for a
    failure that stopped only some replicas, its replicas' 1/D share of the steps while they were out
    (replicas_out). Not in `lost_seconds`, which is time the run did not train at all."""
    contained: bool = False
    """The failure stopped only some replicas (failure_domain replica); the attempt went on."""
    rejoined_at: float | None = None
    """A failure that stopped only some replicas: when they trained again (the survivors' recovery is
    `recovered_at`, their first step after it)."""

    @property
    def detection_s(self) -> float:
        return self.detected_at - self.onset

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.detected_at

    def to_dict(self) -> dict[str, Any]:
        recovery = self.recovery_s
        return {"attempt": self.attempt, "cause": self.cause, "onset": self.onset, "detected_at": self.detected_at,
                "recovered_at": self.recovered_at, "detection_seconds": self.detection_s,
                "recovery_seconds": recovery, "waiting_seconds": self.waiting_s,
                "restart_seconds": None if recovery is None else max(0.0, recovery - self.waiting_s - self.restore_s),
                "restore_seconds": self.restore_s,
                "recomputation_seconds": self.recomputation_s, "degraded_seconds": self.degraded_s,
                **({"contained": True, "rejoined_at": self.rejoined_at} if self.contained else {}),
                "lost_seconds": None if recovery is None else self.detection_s + recovery + self.recomputation_s}


@dataclass
class Accounting:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)
    attempts: list["Accounting"] = field(default_factory=list)
    """The same for each attempt's share of wall time: attempt k from its start (the first from
    submission) to the next attempt's start (the last to the end)."""
    attempt: int | None = None
    """Which attempt this is (None for the whole run)."""
    failures: list[FailureTiming] = field(default_factory=list)
    degraded_s: dict[str, float] = field(default_factory=dict)
    """`degraded_capacity` by its cause: smaller_mesh and replicas_out (the module docstring)."""
    preemptions: list["Preemption"] = field(default_factory=list)

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ettr": self.ettr, "wall_seconds": self.wall_s, "productive_seconds": self.productive_s,
                               "badput_seconds": dict(self.badput_s), "degraded_seconds": dict(self.degraded_s)}
        if self.attempt is not None:
            return {"attempt": self.attempt, **out}
        out["attempts"] = [a.to_dict() for a in self.attempts]
        out["failures"] = [f.to_dict() for f in self.failures]
        out["preemptions"] = [dataclasses.asdict(p) for p in self.preemptions]
        return out


@dataclass(frozen=True)
class Preemption:
    """A run stopped at a step boundary for a higher-priority one (`preempted`): not a failure."""
    attempt: int
    step: int
    at: float
    """When every rank had stopped (the step committed)."""
    last_step_end: float
    resumed_at: float | None
    """The next attempt's start (None: not yet)."""
    waited_s: float
    """In the queue: `preempted` -> the next attempt's start (waiting_for_capacity)."""


def account(events: Sequence[dict[str, Any]], spans: Sequence[StepSpan], *, end: float,
            save_steps: Iterable[int] = ()) -> Accounting:
    """Categorise [submitted, end). `save_steps`: steps after which a checkpoint save began."""
    submitted = next((e["time"] for e in events if e["kind"] == EventKind.SUBMITTED), None)
    if submitted is None:
        raise ValueError("the timeline has no `submitted` event")
    start = float(submitted)
    end = max(end, start)
    intervals: list[tuple[float, float, str]] = []
    kept = _kept(spans)
    saves = set(save_steps)
    by_attempt: dict[int, list[StepSpan]] = {}
    for s in spans:
        by_attempt.setdefault(s.attempt, []).append(s)
        intervals.append((s.start, s.end, "productive" if s in kept else "recomputation"))
    for attempt_spans in by_attempt.values():
        attempt_spans.sort(key=lambda s: s.end)
        for before, after in zip(attempt_spans, attempt_spans[1:]):
            intervals.append((before.end, after.start, "checkpoint_stall" if before.step in saves else "other"))

    succeeded = next((e["time"] for e in events if e["kind"] == EventKind.SUCCEEDED), None)
    if succeeded is not None and spans:
        last = max(spans, key=lambda s: s.end)
        if last.step in saves:  # the run's final save: it ends when the checkpoint is committed
            intervals.append((last.end, succeeded, "checkpoint_stall"))

    started = {e["attempt"]: e["time"] for e in events if e["kind"] == EventKind.ATTEMPT_STARTED}
    first_attempt = min(started) if started else None
    if first_attempt is not None:
        intervals.append((start, started[first_attempt], "queueing"))
    for attempt, t in started.items():
        own = by_attempt.get(attempt, [])
        first_step = min((s.start for s in own), default=None)
        if first_step is not None:
            intervals.append((t, first_step, "startup" if attempt == first_attempt else "restart_restore"))

    detected = [e for e in events if e["kind"] == EventKind.FAILURE_DETECTED]
    failures: list[FailureTiming] = []
    # Indexes so that each failure costs O(log n), not a scan (a 54-day run has ~400 of them).
    ends_by_attempt = {a: [s.end for s in own] for a, own in by_attempt.items()}  # sorted by end above
    starts = sorted(s.start for s in spans)
    attempt_starts = sorted(started.values())
    drills_by_attempt: dict[int, list[float]] = {}
    for e in events:
        if e["kind"] == EventKind.DRILL_INJECTED:
            drills_by_attempt.setdefault(e["attempt"], []).append(e["time"])
    wait_times = sorted(e["time"] for e in events
                        if e["kind"] == EventKind.DECISION and e["detail"].get("action") == "wait")
    attempt_at = {t: a for a, t in started.items()}
    restore_s: dict[int, float] = {}  # attempt -> its slowest rank's load
    for e in events:
        if e["kind"] == EventKind.RESTORED:
            restore_s[e["attempt"]] = max(restore_s.get(e["attempt"], 0.0), float(e["detail"].get("seconds") or 0.0))
    out_spans = _replicas_out(events, end)
    back_at: dict[float, float] = {}  # failure time -> when the last of its replicas trained again
    for o in out_spans:
        back_at[o.failure] = max(back_at.get(o.failure, o.end), o.end)
    for e in events:  # the survivors' stall while formed replicas receive their state and join
        if e["kind"] == EventKind.REPLICA_REJOINED and "at" in e["detail"]:
            at = float(e["detail"]["at"])
            intervals.append((at - float(e["detail"].get("seconds") or 0.0), at, "restart_restore"))
    intervals += _resyncs(events, ends_by_attempt, starts, end)
    preemptions = _preemptions(events, ends_by_attempt, attempt_starts, end)
    for p in preemptions:
        intervals.append((p.last_step_end, p.at, "checkpoint_stall"))  # the stopped step's commit
        intervals.append((p.at, p.resumed_at if p.resumed_at is not None else end, "waiting_for_capacity"))
    for e in events:  # (a replica drain stops only those replicas: replica_lost and replica_rejoined say the rest)
        if e["kind"] == EventKind.DRAINED and "replicas" not in e["detail"]:
            t = float(e["time"])
            intervals.append((_last_end(ends_by_attempt, e["attempt"], t, default=t), t, "checkpoint_stall"))
            k = bisect.bisect_right(attempt_starts, t)
            nxt = attempt_starts[k] if k < len(attempt_starts) else end
            f = bisect.bisect_left(starts, nxt)
            intervals.append((t, starts[f] if f < len(starts) else end, "restart_restore"))
    for failure in detected:
        attempt, t_detected = failure["attempt"], failure["time"]
        last_end = _last_end(ends_by_attempt, attempt, t_detected, default=started.get(attempt, start))
        drill = [t for t in drills_by_attempt.get(attempt, []) if last_end <= t <= t_detected]
        onset = max(drill) if drill else last_end
        intervals.append((last_end, onset, "recomputation"))  # the step in flight, lost
        intervals.append((onset, t_detected, "failure_detection"))
        if failure["detail"].get("replicas") is not None:  # only those replicas stopped: the attempt goes on
            k = bisect.bisect_left(starts, t_detected)
            resumed = starts[k] if k < len(starts) else None
            intervals.append((t_detected, resumed if resumed is not None else end, "restart_restore"))
            back = back_at.get(t_detected, end)
            failures.append(FailureTiming(attempt, str(failure["detail"].get("cause", "unknown")), onset, t_detected,
                                          resumed, recomputation_s=onset - last_end, contained=True,
                                          rejoined_at=back if back < end else None))
            continue
        j = bisect.bisect_left(attempt_starts, t_detected)
        later = j < len(attempt_starts)
        next_start = attempt_starts[j] if later else end
        k = bisect.bisect_left(starts, next_start)
        next_first_step = starts[k] if k < len(starts) else next_start
        recovered = next_first_step if later and k < len(starts) else None
        w = bisect.bisect_left(wait_times, t_detected)
        waits = wait_times[w:w + 1] if w < len(wait_times) and wait_times[w] <= next_start else []
        redone = sum(s.end - s.start for s in by_attempt.get(attempt, []) if s not in kept and s.end <= t_detected)
        failures.append(FailureTiming(attempt, str(failure["detail"].get("cause", "unknown")), onset, t_detected,
                                      recovered, recomputation_s=redone + (onset - last_end),
                                      waiting_s=next_start - waits[0] if waits else 0.0,
                                      restore_s=restore_s.get(attempt_at[next_start], 0.0) if later else 0.0,
                                      next_attempt=attempt_at[next_start] if later else None))
        if waits:
            intervals.append((t_detected, waits[0], "restart_restore"))
            intervals.append((waits[0], next_start, "waiting_for_capacity"))
            intervals.append((next_start, next_first_step, "restart_restore"))
        else:
            intervals.append((t_detected, next_first_step, "restart_restore"))

    segments = _partition(intervals, start, end)
    excess = _straggler_excess(events, kept, by_attempt)
    costs = _capacity(events, kept, excess, out_spans)
    straggler = _by_attempt(excess)
    whole = _total(segments, start, end, sum(straggler.values()), costs.total())
    whole.failures = [dataclasses.replace(f, degraded_s=costs.smaller_mesh.get(f.next_attempt, 0.0))
                      if f.next_attempt is not None else dataclasses.replace(f, degraded_s=costs.by_failure.get(f.detected_at, 0.0))
                      for f in failures]
    whole.preemptions = preemptions
    bounds = sorted((t, a) for a, t in started.items())
    seg_ends = [y for _, y, _ in segments]  # segments are in time order and do not overlap
    for i, (t, attempt) in enumerate(bounds):
        a = start if i == 0 else max(t, start)
        b = bounds[i + 1][0] if i + 1 < len(bounds) else end
        first = bisect.bisect_right(seg_ends, a)
        window = []
        for x, y, c in segments[first:]:
            if x >= b:
                break
            if min(y, b) > max(x, a):
                window.append((max(x, a), min(y, b), c))
        part = _total(window, a, max(a, b), straggler.get(attempt, 0.0), costs.total(attempt))
        part.attempt = attempt
        whole.attempts.append(part)
    return whole


def _last_end(ends_by_attempt: dict[int, list[float]], attempt: int, t: float, *, default: float) -> float:
    """The end of `attempt`'s last step finished by `t` (its ends sorted), else `default`."""
    ends = ends_by_attempt.get(attempt, [])
    i = bisect.bisect_right(ends, t)
    return ends[i - 1] if i else default


def _preemptions(events: Sequence[dict[str, Any]], ends_by_attempt: dict[int, list[float]],
                 attempt_starts: list[float], end: float) -> list[Preemption]:
    out = []
    for e in events:
        if e["kind"] != EventKind.PREEMPTED:
            continue
        t = float(e["time"])
        k = bisect.bisect_right(attempt_starts, t)
        resumed = attempt_starts[k] if k < len(attempt_starts) else None
        out.append(Preemption(attempt=e["attempt"], step=int(e["detail"].get("step", 0)), at=t,
                              last_step_end=_last_end(ends_by_attempt, e["attempt"], t, default=t), resumed_at=resumed,
                              waited_s=(resumed if resumed is not None else end) - t))
    return out


def _resyncs(events: Sequence[dict[str, Any]], ends_by_attempt: dict[int, list[float]], starts: list[float],
             end: float) -> list[tuple[float, float, str]]:
    """A step discarded with nothing lost (`replica_step_discarded` -> `replica_resync`): the work of
    the step in flight is recomputation, the wait for the controller's epoch detection, and the epoch's
    forming up to the next step restart_restore."""
    out: list[tuple[float, float, str]] = []
    discards = sorted(e["time"] for e in events if e["kind"] == EventKind.REPLICA_STEP_DISCARDED)
    for e in events:
        if e["kind"] != EventKind.REPLICA_RESYNC:
            continue
        t = float(e["time"])
        last_end = _last_end(ends_by_attempt, e["attempt"], t, default=t)
        d = bisect.bisect_left(discards, last_end)
        discarded = min(discards[d], t) if d < len(discards) else t
        k = bisect.bisect_left(starts, t)
        resumed = starts[k] if k < len(starts) else end
        out += [(last_end, discarded, "recomputation"), (discarded, t, "failure_detection"),
                (t, resumed, "restart_restore")]
    return out


def _total(segments: list[tuple[float, float, str]], start: float, end: float, straggler: float,
           degraded: dict[str, float]) -> Accounting:
    totals: dict[str, float] = {}
    for a, b, category in segments:
        totals[category] = totals.get(category, 0.0) + (b - a)
    productive = totals.pop("productive", 0.0)
    # Neither bound holds back anything when kept steps do not overlap (the costs are shares of their time).
    straggler = min(straggler, productive)
    scale = min(1.0, (productive - straggler) / sum(degraded.values())) if sum(degraded.values()) > 0 else 1.0
    degraded = {cause: v * scale for cause, v in degraded.items()}
    badput = {c: totals.get(c, 0.0) for c in CATEGORIES}
    badput["straggler_slowdown"] = straggler
    badput["degraded_capacity"] = sum(degraded.values())
    return Accounting(wall_s=end - start, productive_s=productive - straggler - badput["degraded_capacity"],
                      badput_s=badput, degraded_s=degraded)


def _world(mesh: Any) -> int:
    mesh = mesh or {}
    return int(mesh.get("dp", 1)) * int(mesh.get("pp", 1)) * int(mesh.get("tp", 1))


@dataclass(frozen=True)
class _Out:
    """One replica out of training (failure_domain replica)."""
    failure: float
    """The time of the failure that took it out (its `replica_lost`, and its `failure_detected`)."""
    start: float
    end: float
    """When it trained again: its `replica_rejoined` (`at`), a new attempt (which forms every replica),
    or the accounting's end."""
    of: int
    """The attempt's replicas (D)."""


def _replicas_out(events: Sequence[dict[str, Any]], end: float) -> list[_Out]:
    """Each replica's stretches out of training. A replica lost again while out stays the first
    failure's until it rejoins."""
    out: list[_Out] = []
    lost: dict[int, tuple[float, int]] = {}  # replica -> (lost at, of)
    for e in events:
        d = e["detail"]
        if e["kind"] == EventKind.REPLICA_LOST:
            for r in d.get("replicas", ()):
                lost.setdefault(int(r), (float(e["time"]), int(d.get("of", 1))))
        elif e["kind"] == EventKind.REPLICA_REJOINED:
            at = float(d.get("at", e["time"]))
            for r in d.get("replicas", ()):
                if (was := lost.pop(int(r), None)) is not None:
                    out.append(_Out(was[0], was[0], max(at, was[0]), was[1]))
        elif e["kind"] == EventKind.ATTEMPT_STARTED:  # a new attempt forms every replica
            out += [_Out(t, t, max(float(e["time"]), t), of) for t, of in lost.values()]
            lost = {}
    return out + [_Out(t, t, max(end, t), of) for t, of in lost.values()]


@dataclass
class _Costs:
    """degraded_capacity's two parts (the module docstring)."""
    smaller_mesh: dict[int, float] = field(default_factory=dict)
    """attempt -> what its mesh being smaller than the planned one cost."""
    replicas_out: dict[int, float] = field(default_factory=dict)
    """attempt -> what training without its replicas that were out cost."""
    by_failure: dict[float, float] = field(default_factory=dict)
    """failure time -> of replicas_out, the share of the replicas it took out."""

    def total(self, attempt: int | None = None) -> dict[str, float]:
        parts = {"smaller_mesh": self.smaller_mesh, "replicas_out": self.replicas_out}
        return {cause: (sum(v.values()) if attempt is None else v.get(attempt, 0.0)) for cause, v in parts.items()}


def _capacity(events: Sequence[dict[str, Any]], kept: set[StepSpan], excess: dict[StepSpan, float],
              outs: list[_Out]) -> _Costs:
    """Each kept step's time (its straggler excess aside) split as the module docstring says: one pass
    over the steps in time order, each replica's stretch out found by bisection (a 54-day run at
    131,072 GPUs has thousands of them, overlapping)."""
    ordered = sorted(kept, key=lambda s: s.start)
    starts = [s.start for s in ordered]
    diff = [0.0] * (len(ordered) + 1)
    bounds = []
    for o in outs:
        i, j = bisect.bisect_left(starts, o.start), bisect.bisect_left(starts, o.end)
        bounds.append((i, j))
        diff[i] += 1.0 / o.of
        diff[j] -= 1.0 / o.of
    out_share = [min(1.0, max(0.0, x)) for x in itertools.accumulate(diff[:-1])]  # k/D when each step began
    throughput = _throughput(events, ordered, out_share)
    costs = _Costs()
    trained = [0.0]  # prefix sums of each step's time at its mesh's throughput
    for s, share in zip(ordered, out_share):
        rest = s.end - s.start - excess.get(s, 0.0)
        mesh = throughput.get(s.attempt, 1.0)
        if mesh < 1.0:
            costs.smaller_mesh[s.attempt] = costs.smaller_mesh.get(s.attempt, 0.0) + rest * (1.0 - mesh)
        if share > 0.0:
            costs.replicas_out[s.attempt] = costs.replicas_out.get(s.attempt, 0.0) + rest * mesh * share
        trained.append(trained[-1] + rest * mesh)
    for o, (i, j) in zip(outs, bounds):
        costs.by_failure[o.failure] = costs.by_failure.get(o.failure, 0.0) + (trained[j] - trained[i]) / o.of
    return costs


def _throughput(events: Sequence[dict[str, Any]], ordered: list[StepSpan], out_share: list[float]) -> dict[int, float]:
    """attempt -> its mesh's throughput against the planned mesh's (1 where it is the planned mesh):
    medians of the steps with every replica in."""
    planned = next((_world(e["detail"].get("mesh")) for e in events if e["kind"] == EventKind.PLANNED), 0)
    worlds = {e["attempt"]: _world(e["detail"].get("mesh")) for e in events if e["kind"] == EventKind.ATTEMPT_STARTED}
    if not planned and worlds:
        planned = worlds[min(worlds)]
    if not planned or all(w >= planned for w in worlds.values()):
        return {}
    whole: dict[int, list[float]] = {}
    every: dict[int, list[float]] = {}
    for s, share in zip(ordered, out_share):
        every.setdefault(s.attempt, []).append(s.end - s.start)
        if share == 0.0:
            whole.setdefault(s.attempt, []).append(s.end - s.start)
    full = [d for a, durations in whole.items() if worlds.get(a, 0) >= planned for d in durations]
    reference = statistics.median(full) if full else None
    out: dict[int, float] = {}
    for attempt, world in worlds.items():
        own = whole.get(attempt) or every.get(attempt)
        if world >= planned or not own:
            continue
        out[attempt] = (min(1.0, reference / max(statistics.median(own), 1e-12)) if reference is not None
                        else world / planned)
    return out


def _kept(spans: Sequence[StepSpan]) -> set[StepSpan]:
    """The execution of each step number whose progress lasted: the last one. An execution is lost
    when a later one redoes its step (a rollback), or when an earlier step is redone after it."""
    ordered = sorted(spans, key=lambda s: s.end)
    kept: list[StepSpan] = []
    for s in ordered:
        while kept and kept[-1].step >= s.step:  # a rollback: everything from this step on was lost
            kept.pop()
        kept.append(s)
    return set(kept)


def _partition(intervals: list[tuple[float, float, str]], start: float, end: float) -> list[tuple[float, float, str]]:
    """[start, end) cut into segments: every instant goes to the highest-priority interval covering
    it, or to `other`. One sweep over the interval ends (n log n)."""
    rank = {c: i for i, c in enumerate(_PRIORITY)}
    edges: list[tuple[float, int, int]] = []
    for a, b, c in intervals:
        a, b = max(a, start), min(b, end)
        if b > a:
            edges.append((a, 1, rank[c]))
            edges.append((b, -1, rank[c]))
    edges.sort()
    active = [0] * len(_PRIORITY)
    segments: list[tuple[float, float, str]] = []
    at = start
    for t, delta, r in edges:
        if t > at:
            top = next((i for i, n in enumerate(active) if n > 0), None)
            segments.append((at, t, _PRIORITY[top] if top is not None else "other"))
            at = t
        active[r] += delta
    if end > at:
        top = next((i for i, n in enumerate(active) if n > 0), None)
        segments.append((at, end, _PRIORITY[top] if top is not None else "other"))
    return segments


def _straggler_excess(events: Sequence[dict[str, Any]], kept: set[StepSpan],
                      by_attempt: dict[int, list[StepSpan]]) -> dict[StepSpan, float]:
    """In each attempt, kept steps after its first straggler verdict cost what they took above the
    attempt's median step before the verdict."""
    excess: dict[StepSpan, float] = {}
    flagged_by_attempt: dict[int, list[int]] = {}
    for e in events:
        if e["kind"] == EventKind.STRAGGLER:
            flagged_by_attempt.setdefault(e["attempt"], []).append(e["detail"].get("step", 0))
    for attempt, own in by_attempt.items():
        flagged = flagged_by_attempt.get(attempt)
        if not flagged:
            continue
        since = min(flagged)
        before = [s.end - s.start for s in own if s.step < since]
        if not before:
            continue
        baseline = statistics.median(before)
        excess.update((s, max(0.0, (s.end - s.start) - baseline)) for s in own if s.step >= since and s in kept)
    return excess


def _by_attempt(per_step: dict[StepSpan, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for s, v in per_step.items():
        out[s.attempt] = out.get(s.attempt, 0.0) + v
    return out
