"""Every `goodput_*` Prometheus metric: its name, type, labels and help, defined here once. Dashboards,
alert rules and their tests read `METRICS`; nothing else in the code names a metric.

The service exports them from what it already keeps — each run's controller (state, progress, the
event timeline, the accounting) and the cluster view — through one collector that prometheus-client
asks at scrape time. So nothing can drift out of step with the Run objects the API shows, and a
restarted service exports the same counters again from the restored timeline. The parts that grow
with a run (step times, checkpoint saves, SDC and failure counts) are folded in incrementally, so a
scrape costs O(new steps and events), not O(run).

Labels stay low-cardinality: run, rank, node, cause, kind, state, category, outcome, team, priority —
never a step number or free text.
"""

from __future__ import annotations

import bisect
import statistics
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric as Family)
from prometheus_client.registry import Collector

from controller.accounting import CATEGORIES
from controller.events import EventKind
from controller.failure_policy import FailureCause
from controller.run_state import RunState
from controller.state import RunController
from controller.topology import NodeState

if TYPE_CHECKING:
    from controller.service.service import Service

FAST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds, for step times and checkpoint stalls (a tiny CPU step is ~0.1 s, a big GPU step ~10 s)."""
SLOW_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Seconds, for detection, recovery and checkpoint saves."""

SDC_KINDS = (EventKind.SDC_SUSPECT, EventKind.SDC_TRANSIENT, EventKind.LOSS_ANOMALY)
"""Health events of the silent-data-corruption probes (`kind` label of goodput_sdc_events_total)."""


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    """gauge, counter or histogram (a counter's samples carry the `_total` suffix; `name` does not)."""
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for it (what a query may name)."""
        if self.type == "counter":
            return (f"{self.name}_total", f"{self.name}_created")
        if self.type == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "count", "sum", "created"))
        return (self.name,)


_DEFS: list[Metric] = []


def _m(name: str, type_: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...] = ()) -> Metric:
    metric = Metric(name, type_, help_, labels, buckets)
    _DEFS.append(metric)
    return metric


RUN_STATE = _m("goodput_run_state", "gauge", "1 for the run's current state (pending, planning, launching, running, "
               "recovering, succeeded, failed, cancelled), 0 for the others", ("run", "state"))
RUN_ATTEMPT = _m("goodput_run_attempt", "gauge", "The run's current attempt number (0 for the first launch)", ("run",))
RUN_STEP = _m("goodput_run_step", "gauge", "Last step whose progress the run holds (finished or restored)", ("run",))
RUN_TOTAL_STEPS = _m("goodput_run_total_steps", "gauge", "Steps the run trains to", ("run",))
RUN_LOSS = _m("goodput_run_loss", "gauge", "Training loss of the last finished step", ("run",))
RUN_TOKENS = _m("goodput_run_tokens_per_second", "gauge", "Tokens per second of the last finished step, whole mesh",
                ("run",))
RUN_PROGRESS_TIME = _m("goodput_run_last_progress_timestamp_seconds", "gauge",
                       "Unix time the run last showed progress (a step finished, or its attempt started)", ("run",))
LIVE_REPLICAS = _m("goodput_run_live_replicas", "gauge", "Data-parallel replicas of the current attempt training now: "
                   "fewer than goodput_run_replicas while a lost one re-forms (failure_domain replica)", ("run",))
REPLICAS = _m("goodput_run_replicas", "gauge", "Data-parallel replicas of the current attempt's mesh", ("run",))
RUN_PENDING = _m("goodput_run_pending_seconds", "gauge",
                 "Seconds the run has waited for capacity since submission (0 once admitted)", ("run",))
STEP_SECONDS = _m("goodput_step_seconds", "histogram", "Wall time of each finished step, every attempt", ("run",),
                  FAST_BUCKETS)
ETTR = _m("goodput_run_ettr", "gauge", "Effective training time ratio: time of steps whose progress was kept / wall "
          "time since submission", ("run",))
ATTEMPT_ETTR = _m("goodput_attempt_ettr", "gauge", "ETTR of the run's current attempt over its share of wall time",
                  ("run",))
WALL = _m("goodput_run_wall_seconds", "gauge", "Wall time since submission (to the end, once ended)", ("run",))
PRODUCTIVE = _m("goodput_run_productive_seconds", "gauge", "Wall time that became kept training progress",
                ("run",))
BADPUT = _m("goodput_run_badput_seconds", "gauge", "Wall time lost, by category (queueing, startup, checkpoint_stall, "
            "failure_detection, restart_restore, recomputation, straggler_slowdown, degraded_capacity, waiting_for_capacity, "
            "other); "
            "with goodput_run_productive_seconds it adds up to goodput_run_wall_seconds", ("run", "category"))
FAILURES = _m("goodput_failures", "counter", "Failures detected, by cause", ("run", "cause"))
DETECTION = _m("goodput_failure_detection_seconds", "histogram",
               "Failure onset (a drill's injection, else the last finished step) to detection", ("run",), SLOW_BUCKETS)
RECOVERY = _m("goodput_recovery_seconds", "histogram",
              "Failure detection to the first step of the next attempt (re-mesh, launch, restore)", ("run",),
              SLOW_BUCKETS)
CKPT_SAVE = _m("goodput_checkpoint_save_seconds", "histogram",
               "Duration of each committed checkpoint save, start to commit (mostly in the background)", ("run",),
               SLOW_BUCKETS)
CKPT_STALL = _m("goodput_checkpoint_stall_seconds", "histogram",
                "Time each checkpoint save blocked the training loop (staging)", ("run",), FAST_BUCKETS)
CKPT_FAILED = _m("goodput_checkpoint_failures", "counter", "Checkpoint saves that did not commit", ("run",))
SNAPSHOT_STALL = _m("goodput_peer_snapshot_stall_seconds", "histogram",
                    "Time each peer snapshot held the training loop (the copy into host memory)", ("run",), FAST_BUCKETS)
RECOVERIES = _m("goodput_recoveries", "counter", "Recoveries by where the next attempt's state came from (peer: "
                "snapshots in the nodes' memory, store: a checkpoint, scratch: none)", ("run", "source"))
STEPS_REDONE = _m("goodput_steps_redone", "counter", "Steps trained again after recoveries (the step each failure "
                  "was detected at - the step the next attempt started from)", ("run",))
DISCARDED = _m("goodput_replica_steps_discarded", "counter", "Steps the live replicas discarded (a cross-replica "
               "collective failed or timed out: nothing applied anywhere), failure_domain replica", ("run",))
RESYNCS = _m("goodput_replica_resyncs", "counter", "Membership epochs published to resolve a discarded step with no "
             "replica lost (the members re-form and even out their state)", ("run",))
HEAL = _m("goodput_replica_heal_seconds", "histogram", "A lost replica's decision (replica_lost) to its rejoin with "
          "the others' state, failure_domain replica", ("run",), SLOW_BUCKETS)
CKPT_BYTES = _m("goodput_checkpoint_last_bytes", "gauge", "Bytes of the latest committed checkpoint", ("run",))
CKPT_STEP = _m("goodput_checkpoint_last_step", "gauge", "Step of the latest committed checkpoint", ("run",))
CKPT_AGE = _m("goodput_checkpoint_age_seconds", "gauge",
              "Seconds since the latest commit (since the attempt started, before any)", ("run",))
CKPT_INTERVAL = _m("goodput_checkpoint_interval_seconds", "gauge",
                   "Expected seconds between commits: the checkpoint interval in steps x the median step time",
                   ("run",))
STRAGGLER = _m("goodput_rank_straggler_score", "gauge", "A rank's compute time / its pipeline stage peers' median "
               "(1 = typical; above the spec's straggler_ratio it is a straggler)", ("run", "rank", "node"))
STRAGGLER_RATIO = _m("goodput_straggler_ratio", "gauge", "The run's straggler_ratio (the score a straggler exceeds)",
                     ("run",))
STRAGGLERS = _m("goodput_straggler_events", "counter", "Straggler verdicts, by rank", ("run", "rank", "node"))
SDC = _m("goodput_sdc_events", "counter", "Silent-data-corruption probe events by kind (sdc_suspect: a verdict that "
         "rolls back and quarantines; sdc_transient: a mismatch that did not repeat; loss_anomaly)", ("run", "kind"))
QUARANTINED = _m("goodput_quarantined_nodes", "gauge", "Nodes the run quarantined", ("run",))
NODES = _m("goodput_nodes", "gauge", "Nodes the service sees, by state (healthy, spare, quarantined, lost)",
           ("state",))
NODE_STATE = _m("goodput_node_state", "gauge", "1 for a node's current state, 0 for the others", ("node", "state"))
RUN_INFO = _m("goodput_run_info", "gauge", "1 for each run, labelled with its team and priority class (join on run)",
              ("run", "team", "priority"))
PREEMPTIONS = _m("goodput_preemptions", "counter", "Times the run was stopped at a step boundary for a "
                 "higher-priority run and put back in the queue (not failures)", ("run",))
TEAM_GPUS = _m("goodput_team_gpus", "gauge", "GPUs the team's admitted runs hold now", ("team",))
TEAM_QUOTA = _m("goodput_team_gpu_quota", "gauge", "The team's GPU quota (teams that have one)", ("team",))
TEAM_QUEUED = _m("goodput_team_queued_runs", "gauge", "The team's runs waiting to be admitted", ("team",))
TEAM_WAIT = _m("goodput_team_queue_wait_seconds", "gauge", "The longest wait of the team's queued runs (0: none queued)",
               ("team",))
DRILLS = _m("goodput_drills", "counter", "Drills by kind and outcome (recovered, failed, cancelled, detected, pending, "
            "not_detected, not_recovered, not_injected, ...)", ("run", "kind", "outcome"))

METRICS: tuple[Metric, ...] = tuple(_DEFS)
"""Every metric goodput exports."""


def exported_series() -> set[str]:
    """Every sample name the service can export (what dashboards and alert rules may name)."""
    return {s for m in METRICS for s in m.series}


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def samples(self) -> tuple[list[tuple[str, float]], float]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.buckets + (float("inf"),), self.counts):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out, self.sum


@dataclass
class _Fold:
    """What a run's growing lists have added up to so far (folded in on each scrape, in order)."""
    spans_seen: int = 0
    events_seen: int = 0
    step: _Histogram = field(default_factory=lambda: _Histogram(STEP_SECONDS.buckets))
    save: _Histogram = field(default_factory=lambda: _Histogram(CKPT_SAVE.buckets))
    stall: _Histogram = field(default_factory=lambda: _Histogram(CKPT_STALL.buckets))
    failures: dict[str, int] = field(default_factory=lambda: {c.value: 0 for c in FailureCause})
    sdc: dict[str, int] = field(default_factory=lambda: {k: 0 for k in SDC_KINDS})
    stragglers: dict[tuple[str, str], int] = field(default_factory=dict)
    checkpoint_failures: int = 0
    last_commit: dict[str, Any] | None = None
    attempt_started_at: float | None = None
    interval_steps: int | None = None
    snapshots_seen: int = 0
    snapshot: _Histogram = field(default_factory=lambda: _Histogram(SNAPSHOT_STALL.buckets))
    recoveries: dict[str, int] = field(default_factory=lambda: {"peer": 0, "store": 0, "scratch": 0})
    steps_redone: int = 0
    failed_at_step: int | None = None
    discarded: set[tuple[int, int, int]] = field(default_factory=set)
    """(attempt, epoch, step) of each discarded step (every replica that discards it says so)."""
    resyncs: int = 0
    heal: _Histogram = field(default_factory=lambda: _Histogram(HEAL.buckets))
    lost_at: dict[tuple[int, int], float] = field(default_factory=dict)
    """(attempt, replica) -> when it was lost, until it rejoins."""

    def fold(self, c: RunController) -> None:
        spans = c.progress.spans
        for span in spans[self.spans_seen:]:
            self.step.observe(span.end - span.start)
        self.spans_seen = len(spans)
        stalls = c.progress.snapshot_s
        for stall in list(stalls)[max(0, len(stalls) - (c.progress.snapshots - self.snapshots_seen)):]:
            self.snapshot.observe(stall)
        self.snapshots_seen = c.progress.snapshots
        for e in c.events.since(self.events_seen):
            d = e.detail
            if e.kind == EventKind.FAILURE_DETECTED:
                cause = str(d.get("cause", "unknown"))
                self.failures[cause] = self.failures.get(cause, 0) + 1
                self.failed_at_step = int(d.get("step", 0))
            elif e.kind in SDC_KINDS:
                self.sdc[e.kind] += 1
            elif e.kind == EventKind.STRAGGLER:
                key = (str(d.get("rank")), str(d.get("node")))
                self.stragglers[key] = self.stragglers.get(key, 0) + 1
            elif e.kind == EventKind.CHECKPOINT_COMMITTED:
                self.last_commit = {"time": e.time, "step": d.get("step", 0), "bytes": d.get("bytes", 0)}
                if d.get("seconds") is not None:
                    self.save.observe(float(d["seconds"]))
            elif e.kind == EventKind.CHECKPOINT_STAGED and d.get("blocked_s") is not None:
                self.stall.observe(float(d["blocked_s"]))
            elif e.kind == EventKind.CHECKPOINT_FAILED:
                self.checkpoint_failures += 1
            elif e.kind == EventKind.REPLICA_STEP_DISCARDED:
                self.discarded.add((e.attempt, int(d.get("epoch", -1)), int(d.get("step", -1))))
            elif e.kind == EventKind.REPLICA_RESYNC:
                self.resyncs += 1
            elif e.kind == EventKind.REPLICA_LOST:
                for replica in d.get("replicas", ()):
                    self.lost_at[(e.attempt, int(replica))] = e.time
            elif e.kind == EventKind.REPLICA_REJOINED:
                for replica in d.get("replicas", ()):
                    if (lost := self.lost_at.pop((e.attempt, int(replica)), None)) is not None:
                        self.heal.observe(max(0.0, float(d.get("at", e.time)) - lost))
            elif e.kind == EventKind.CHECKPOINT_INTERVAL and d.get("steps"):
                self.interval_steps = int(d["steps"])
            elif e.kind == EventKind.ATTEMPT_STARTED:
                self.attempt_started_at = e.time
                if self.failed_at_step is not None:  # a recovery (not the first launch, not a resume)
                    source = d.get("restore_from") or "scratch"
                    self.recoveries[source] = self.recoveries.get(source, 0) + 1
                    self.steps_redone += max(0, self.failed_at_step - int(d.get("start_step", 0)))
                    self.failed_at_step = None
        self.events_seen = len(c.events)


class _Families:
    """Metric families being filled for one scrape, by definition."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def __call__(self, metric: Metric) -> Any:
        family = self.families.get(metric.name)
        if family is None:
            cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                   "histogram": HistogramMetricFamily}[metric.type]
            family = cls(metric.name, metric.help, labels=list(metric.labels))
            self.families[metric.name] = family
        return family


class ServiceCollector(Collector):
    """Exports the service's runs and nodes. Runs that ended more than `keep_finished_s` ago leave
    /metrics (they stay in the API and the registry)."""

    def __init__(self, service: "Service", *, clock: Callable[[], float] | None = None,
                 keep_finished_s: float = 3600.0) -> None:
        self.service = service
        self.clock = clock or service.clock
        self.keep_finished_s = keep_finished_s
        self._folds: dict[str, _Fold] = {}
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Family]:
        return []  # collected on demand; no names to check at registration

    def collect(self) -> Iterator[Family]:
        now = self.clock()
        out = _Families()
        for metric in METRICS:
            out(metric)  # every family present, even with no sample yet
        with self._lock:
            for run_id, controller, lock in self.service.live_controllers():
                with lock:
                    if controller.finished_at is not None and now - controller.finished_at > self.keep_finished_s:
                        continue
                    fold = self._folds.setdefault(run_id, _Fold())
                    if fold.events_seen > len(controller.events):  # a resumed service's fresh controller
                        fold = self._folds[run_id] = _Fold()
                    fold.fold(controller)
                    self._run(out, run_id, controller, fold, now)
                    out(RUN_INFO).add_metric([run_id, self.service.team_of(run_id), controller.spec.priority], 1.0)
        self._nodes(out)
        self._teams(out)
        yield from out.families.values()

    def _run(self, out: _Families, run: str, c: RunController, fold: _Fold, now: float) -> None:
        for state in RunState:
            out(RUN_STATE).add_metric([run, state.value], 1.0 if c.state is state else 0.0)
        out(RUN_ATTEMPT).add_metric([run], max(c.attempt, 0))
        out(RUN_STEP).add_metric([run], c.progress.step)
        out(RUN_TOTAL_STEPS).add_metric([run], c.spec.train.steps)
        if c.progress.loss is not None:
            out(RUN_LOSS).add_metric([run], c.progress.loss)
        if c.progress.tokens_per_s:
            out(RUN_TOKENS).add_metric([run], c.progress.tokens_per_s[-1])
        spans = c.progress.spans
        progress_at = max(spans[-1].end if spans else 0.0, fold.attempt_started_at or c.created_at)
        out(RUN_PROGRESS_TIME).add_metric([run], progress_at)
        if c.config is not None:
            out(REPLICAS).add_metric([run], c.config.mesh.dp_replicas)
            out(LIVE_REPLICAS).add_metric([run], c.config.mesh.dp_replicas - len(c.replicas_out)
                                          if c.state is RunState.RUNNING else 0)
        pending = (c.finished_at or now) - c.created_at if c.state is RunState.PENDING else 0.0
        out(RUN_PENDING).add_metric([run], pending)
        buckets, total = fold.step.samples()
        out(STEP_SECONDS).add_metric([run], buckets, total)

        goodput = c.goodput(now)
        out(ETTR).add_metric([run], goodput["ettr"])
        if goodput["attempts"]:
            out(ATTEMPT_ETTR).add_metric([run], goodput["attempts"][-1]["ettr"])
        out(WALL).add_metric([run], goodput["wall_seconds"])
        out(PRODUCTIVE).add_metric([run], goodput["productive_seconds"])
        for category in CATEGORIES:
            out(BADPUT).add_metric([run, category], goodput["badput_seconds"].get(category, 0.0))
        for cause, n in sorted(fold.failures.items()):
            out(FAILURES).add_metric([run, cause], n)
        detection, recovery = _Histogram(DETECTION.buckets), _Histogram(RECOVERY.buckets)
        for failure in goodput["failures"]:
            detection.observe(failure["detection_seconds"])
            if failure["recovery_seconds"] is not None:
                recovery.observe(failure["recovery_seconds"])
        for metric, hist in ((DETECTION, detection), (RECOVERY, recovery), (CKPT_SAVE, fold.save),
                             (CKPT_STALL, fold.stall)):
            buckets, total = hist.samples()
            out(metric).add_metric([run], buckets, total)
        out(CKPT_FAILED).add_metric([run], fold.checkpoint_failures)
        buckets, total = fold.snapshot.samples()
        out(SNAPSHOT_STALL).add_metric([run], buckets, total)
        for source, n in sorted(fold.recoveries.items()):
            out(RECOVERIES).add_metric([run, source], n)
        out(STEPS_REDONE).add_metric([run], fold.steps_redone)
        out(DISCARDED).add_metric([run], len(fold.discarded))
        out(RESYNCS).add_metric([run], fold.resyncs)
        buckets, total = fold.heal.samples()
        out(HEAL).add_metric([run], buckets, total)

        if fold.last_commit is not None:
            out(CKPT_BYTES).add_metric([run], fold.last_commit["bytes"])
            out(CKPT_STEP).add_metric([run], fold.last_commit["step"])
        every = fold.interval_steps or (c.spec.checkpoint.every_steps
                                        if isinstance(c.spec.checkpoint.every_steps, int) else None)
        if c.spec.checkpoint.uri and every and not c.state.terminal:
            since = max(fold.last_commit["time"] if fold.last_commit else 0.0,
                        fold.attempt_started_at or c.created_at)
            out(CKPT_AGE).add_metric([run], max(0.0, now - since))
            recent = [s.end - s.start for s in spans[-50:]]
            if recent:
                out(CKPT_INTERVAL).add_metric([run], every * statistics.median(recent))

        health = c.health()
        out(STRAGGLER_RATIO).add_metric([run], health["straggler_ratio"])
        for score in health["scores"]:
            out(STRAGGLER).add_metric([run, str(score["rank"]), score["node"]], score["relative"])
        verdicts = {(str(score["rank"]), score["node"]): 0 for score in health["scores"]} | fold.stragglers
        for (rank, node), n in sorted(verdicts.items()):
            out(STRAGGLERS).add_metric([run, rank, node], n)
        for kind, n in fold.sdc.items():
            out(SDC).add_metric([run, kind], n)
        out(QUARANTINED).add_metric([run], len(c.quarantined))
        out(PREEMPTIONS).add_metric([run], c.events.count(EventKind.PREEMPTED))
        drills: dict[tuple[str, str], int] = {}
        for report in c.drill_reports():
            key = (report["kind"], report["outcome"])
            drills[key] = drills.get(key, 0) + 1
        for (kind, outcome), n in sorted(drills.items()):
            out(DRILLS).add_metric([run, kind, outcome], n)

    def _teams(self, out: _Families) -> None:
        for team in self.service.teams_view():
            out(TEAM_GPUS).add_metric([team["name"]], team["gpus_held"])
            if team["gpu_quota"] is not None:
                out(TEAM_QUOTA).add_metric([team["name"]], team["gpu_quota"])
            out(TEAM_QUEUED).add_metric([team["name"]], team["queued"])
            out(TEAM_WAIT).add_metric([team["name"]], team["longest_wait_s"])

    def _nodes(self, out: _Families) -> None:
        view = self.service.cluster_view()
        counts = {s.value: 0 for s in NodeState}
        for node in view["nodes"]:
            counts[node["state"]] = counts.get(node["state"], 0) + 1
            for node_state in NodeState:
                out(NODE_STATE).add_metric([node["name"], node_state.value],
                                           1.0 if node["state"] == node_state.value else 0.0)
        for state, n in counts.items():
            out(NODES).add_metric([state], n)
