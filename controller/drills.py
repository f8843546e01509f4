"""Failure-injection drills: the injector protocol, the schedule of drills still to inject, and the
drill report. The report is a pure function of the run's events, so tests, the CLI and the API read
the same figures. A drill comes from the spec's `drills:` list or is requested on a running run
(`goodput drill RUN KIND`, `POST /v1/runs/{id}/drills`); both go through the same schedule."""

from __future__ import annotations

import enum
import hashlib
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

from controller.events import Event, EventKind
from controller.placement import Placement
from trainer.protocol import PROTOCOL_POINTS

if TYPE_CHECKING:
    from controller.spec import DrillSpec

class DrillKind(enum.StrEnum):
    """The one list of drill kinds. Each names what it hits (`target`), what it fails in the failure
    model (`component`), and its one parameter with its default, if it has one."""

    KILL_NODE = "kill-node"
    KILL_RANK = "kill-rank"
    HANG_RANK = "hang-rank"
    SLOW_RANK = "slow-rank"
    BITFLIP = "bitflip"
    STORAGE_OUTAGE = "storage-outage"
    # Silent faults (DESIGN.md "Silent faults"): nothing the node sends arrives and nothing closes. They
    # act on the node's own network and processes (controller/ray/netfaults.py), so they need a node
    # that is a host of its own (a pod, a machine, the lab's namespaces), never one on loopback.
    POWER_OFF = "power-off"
    PARTITION = "partition"
    SLOW_LINK = "slow-link"
    LOSSY_LINK = "lossy-link"
    FREEZE_NODE = "freeze-node"
    # The replica protocol's own faults (failure_domain: replica): one named collective between replicas
    # fails, or comes too late, on one rank (trainer/protocol.ProtocolFault), with no process or node lost.
    COLLECTIVE_FAULT = "collective-fault"

    @property
    def target(self) -> str:
        """`node`, `rank` or `store` (the run's object store: no target to give)."""
        if self.silent:
            return "node"
        return {"kill-node": "node", "storage-outage": "store"}.get(self.value, "rank")

    @property
    def silent(self) -> bool:
        """Whether it is a silent fault (a node's network or every process of it; nothing closes)."""
        return self.value in ("power-off", "partition", "slow-link", "lossy-link", "freeze-node")

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters this kind takes (of PARAMS)."""
        return {"slow-rank": ("factor",), "storage-outage": ("seconds",), "partition": ("seconds",),
                "freeze-node": ("seconds",), "slow-link": ("delay_ms",), "lossy-link": ("loss",),
                "collective-fault": ("point", "seconds")}.get(self.value, ())

    def default(self, param: str) -> float | str | None:
        """A parameter's default (None for partition's and freeze-node's `seconds`: they last; for
        collective-fault's: the collective fails instead of coming late)."""
        defaults: dict[tuple[str, str], float | str] = {
            ("slow-rank", "factor"): DEFAULT_FACTOR, ("storage-outage", "seconds"): DEFAULT_OUTAGE_S,
            ("slow-link", "delay_ms"): DEFAULT_DELAY_MS, ("lossy-link", "loss"): DEFAULT_LOSS,
            ("collective-fault", "point"): DEFAULT_POINT}
        return defaults.get((self.value, param))

    @property
    def component(self) -> str:
        """What it fails, in the failure model's words (controller.sim)."""
        return {"kill-node": "host", "kill-rank": "rank", "hang-rank": "hang", "bitflip": "sdc",
                "slow-rank": "straggler", "storage-outage": "storage-outage", "power-off": "host",
                "partition": "host", "slow-link": "network", "lossy-link": "network",
                "freeze-node": "host", "collective-fault": "collective"}[self.value]

    @property
    def effect(self) -> str:
        """What it does, in a few words (CLI help, API docs)."""
        return {"kill-node": "SIGKILL the node's raylet", "kill-rank": "SIGKILL a rank's training process",
                "hang-rank": "SIGSTOP a rank's training process",
                "slow-rank": "the rank computes `factor` x slower",
                "bitflip": "flip a high exponent bit of one of the rank's parameters",
                "storage-outage": "the object store refuses writes for `seconds`",
                "power-off": "cut the node's link, then SIGKILL every process on it (silent)",
                "partition": "cut the node's link, its processes alive; `seconds` heals it (silent)",
                "slow-link": "delay everything the node sends by `delay_ms` (tc netem)",
                "lossy-link": "drop `loss` percent of what the node sends (tc netem)",
                "freeze-node": "SIGSTOP every process on the node; `seconds` thaws it (a hung host)",
                "collective-fault": "the rank's next `point` of the replica protocol (reduce, vote, agree, init, "
                                    "sync) fails, or with `seconds` starts that late (past the timeout: a replica "
                                    "too slow); failure_domain: replica"}[self.value]

    @classmethod
    def names(cls) -> str:
        """`kill-node, kill-rank, ..., storage-outage`."""
        return ", ".join(k.value for k in cls)


DEFAULT_FACTOR = 1.5
"""slow-rank: how many times slower the rank computes."""
DEFAULT_OUTAGE_S = 30.0
"""storage-outage: seconds the store refuses writes."""
DEFAULT_DELAY_MS = 50.0
"""slow-link: milliseconds added to everything the node sends."""
DEFAULT_LOSS = 5.0
"""lossy-link: percent of the node's packets dropped."""
DEFAULT_POINT = "reduce"
"""collective-fault: the gradient all-reduce between replicas."""
PARAMS = ("factor", "seconds", "delay_ms", "loss", "point")
"""Every drill parameter (DrillKind.params says which a kind takes)."""


class DrillInjector(Protocol):
    def inject(self, kind: DrillKind, target: str, *, factor: float | None = None, seconds: float | None = None,
               delay_ms: float | None = None, loss: float | None = None, point: str | None = None) -> dict[str, Any]:
        """Do it (`DrillKind.effect`) and say what was hit."""
        ...


class DrillError(ValueError):
    """A drill request that cannot be honoured; the message says what to change."""


@dataclass(frozen=True)
class DrillRequest:
    id: str
    """Unique drill id (`drill-` + 8 hex digits)."""
    kind: DrillKind
    at_step: int | None
    """Inject once the run has finished this step; None: as soon as the current attempt trains."""
    target: str | None
    """Node name or rank number; None: the node or rank of the last rank at injection time."""
    requested_at: float | None = None
    """Unix seconds the request arrived (None for the spec's drills)."""
    factor: float | None = None
    """slow-rank: how many times slower the rank computes (default 1.5)."""
    seconds: float | None = None
    """storage-outage: how long the object store refuses writes (default 30); partition, freeze-node:
    how long until the link heals or the node thaws (default: never, in this run)."""
    delay_ms: float | None = None
    """slow-link: milliseconds added to everything the node sends (default 50)."""
    loss: float | None = None
    """lossy-link: percent of the node's packets dropped (default 5)."""
    point: str | None = None
    """collective-fault: the protocol point that fails (default reduce; trainer/protocol.PROTOCOL_POINTS)."""

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "kind": self.kind, "target": self.target, "at_step": self.at_step,
               "requested_at": self.requested_at}
        for name in self.kind.params:
            out[name] = getattr(self, name) or self.kind.default(name)
        return out

    def params(self) -> dict[str, Any]:
        """Its parameters, as the injector takes them."""
        return {name: getattr(self, name) for name in PARAMS}


def new_drill_id() -> str:
    return f"drill-{uuid.uuid4().hex[:8]}"


def rank_target(target: str | int | None) -> str | None:
    """A rank may come as an int (YAML `target: 2`, JSON) or a string; inside it is a string."""
    return None if target is None else str(target)


def params_problem(kind: DrillKind, factor: float | None = None, seconds: float | None = None,
                   delay_ms: float | None = None, loss: float | None = None, point: str | None = None) -> str | None:
    for name, value in (("factor", factor), ("seconds", seconds), ("delay_ms", delay_ms), ("loss", loss),
                        ("point", point)):
        if value is not None and name not in kind.params:
            owners = ", ".join(k for k in DrillKind if name in k.params)
            return f"{name} is for {owners} drills, not {kind}"
    if point is not None and point not in PROTOCOL_POINTS:
        return f"point = {point!r} is not a point of the replica protocol; give one of {', '.join(PROTOCOL_POINTS)}"
    if factor is not None and factor < 1.0:
        return f"factor = {factor} must be >= 1 (how many times slower the rank computes)"
    if seconds is not None and seconds <= 0:
        return f"seconds = {seconds} must be > 0"
    if delay_ms is not None and not 0 < delay_ms <= 60_000:
        return f"delay_ms = {delay_ms} must be in (0, 60000] (milliseconds added to what the node sends)"
    if loss is not None and not 0 < loss <= 100:
        return f"loss = {loss} must be in (0, 100] (percent of the node's packets dropped)"
    return None


def domain_problem(kind: DrillKind, failure_domain: str, replicas: int) -> str | None:
    """Why a run of this failure domain and this many data-parallel replicas cannot take `kind`: a
    collective-fault needs collectives between replicas to fail."""
    if kind is DrillKind.COLLECTIVE_FAULT and (failure_domain != "replica" or replicas < 2):
        return (f"{kind} fails a collective between data-parallel replicas: the run needs elastic.failure_domain: "
                f"replica and parallelism.dp_replicas >= 2 (it has {failure_domain!r} and {replicas})")
    return None


def default_target(kind: DrillKind, placement: Placement) -> str:
    """The last rank (or its node): the rank least likely to be the one a user watches."""
    last = placement.mesh.world_size - 1
    if kind.target == "store":
        return "store"
    return placement.node_of_rank[last] if kind.target == "node" else str(last)


REPLICA_TARGET = "replica:"
"""`--target replica:K`: a data-parallel replica (its last rank, or that rank's node)."""


def concrete_target(kind: DrillKind, target: str, placement: Placement) -> str:
    """`replica:K` as the rank or node it hits on this placement (the replica's last rank, as a
    drill with no target takes the run's last); any other target as it is."""
    if not target.startswith(REPLICA_TARGET) or kind.target == "store":
        return target
    mesh = placement.mesh
    k = target[len(REPLICA_TARGET):]
    if not k.isdigit() or int(k) >= mesh.dp_replicas:
        return target  # (target_problem says why)
    last = (int(k) + 1) * (mesh.world_size // mesh.dp_replicas) - 1
    return placement.node_of_rank[last] if kind.target == "node" else str(last)


def target_problem(kind: DrillKind, target: str, placement: Placement) -> str | None:
    """Why `target` cannot be hit by `kind` on this placement, or None if it can."""
    if target.startswith(REPLICA_TARGET) and kind.target != "store":
        k, replicas = target[len(REPLICA_TARGET):], placement.mesh.dp_replicas
        if not k.isdigit() or int(k) >= replicas:
            return (f"target {target!r} is not a data-parallel replica of the current attempt; give replica:0 to "
                    f"replica:{replicas - 1}")
        return None
    if kind.target == "store":
        return None if target == "store" else f"{kind} hits the run's object store; give no target (got {target!r})"
    if kind.target == "node":
        nodes = placement.nodes_used()
        if target not in nodes:
            return f"node {target!r} runs no rank of the current attempt; target one of {nodes}"
        return None
    world = placement.mesh.world_size
    if not target.isdigit() or int(target) >= world:
        return f"target {target!r} is not a rank of the current attempt; give a rank from 0 to {world - 1}"
    return None


class DrillSchedule:
    """Drills waiting for their step, in step order (a drill with no step goes first)."""

    def __init__(self, requests: list[DrillRequest] | None = None) -> None:
        self._pending: list[DrillRequest] = []
        for request in requests or []:
            self._add(request)

    def _add(self, request: DrillRequest) -> None:
        self._pending.append(request)
        self._pending.sort(key=lambda r: -1 if r.at_step is None else r.at_step)

    def request(self, now: float, kind: str, *, target: str | None, at_step: int | None, step: int,
                placement: Placement | None, **params: Any) -> DrillRequest:
        """Validate and queue a drill on a live run at `step` (`params`: PARAMS); DrillError says what to fix."""
        if kind not in set(DrillKind):
            raise DrillError(f"drill kind {kind!r} cannot be injected; use one of {DrillKind.names()}")
        kind = DrillKind(kind)
        if (problem := params_problem(kind, **params)) is not None:
            raise DrillError(problem)
        if at_step is not None and at_step < step:
            raise DrillError(f"at_step {at_step} has passed: the run is at step {step}; give a later step "
                             "or leave it out to inject now")
        if target is not None and placement is not None and (problem := target_problem(kind, target, placement)):
            raise DrillError(problem)
        request = DrillRequest(id=new_drill_id(), kind=kind, at_step=at_step, target=target, requested_at=now,
                               **params)
        self._add(request)
        return request

    def pop_due(self, step: int) -> DrillRequest | None:
        """The next drill whose step has come, removed from the schedule."""
        if self._pending and (self._pending[0].at_step is None or self._pending[0].at_step <= step):
            return self._pending.pop(0)
        return None

    def find(self, drill_id: str) -> DrillRequest | None:
        return next((r for r in self._pending if r.id == drill_id), None)

    def pending(self) -> list[DrillRequest]:
        return list(self._pending)


def drill_reports(events: list[Event]) -> list[dict[str, Any]]:
    """One report per injected (or refused) drill: injected_at, detected_at, recovered_at (first step
    finished on the new attempt's ranks, recovery_heard_at when the controller heard of it; for
    storage-outage, the first commit after the outage), steps_lost
    (work redone since the last commit), decision, outcome."""
    return [drill_report(events, i) for i, ev in enumerate(events) if ev.kind in DRILL_EVENTS]


DRILL_EVENTS = (EventKind.DRILL_INJECTED, EventKind.DRILL_FAILED)
FINAL_OUTCOMES = frozenset({"recovered", "failed", "not_injected", "not_detected", "not_recovered", "ridden_out"})
"""Outcomes no later event changes (a report with one need not be computed again)."""


def drill_report(events: list[Event], i: int) -> dict[str, Any]:
    """The report of the drill whose `drill_injected` (or `drill_failed`) is events[i]."""
    ev = events[i]
    if ev.kind == EventKind.DRILL_FAILED:
        return {"id": ev.detail.get("id"), "kind": ev.detail["drill"], "target": ev.detail.get("target"),
                "at_step": ev.detail.get("step"), "injected_at": None, "detected_at": None,
                "cause": None, "attributed_to": None, "decision": None, "recovered_at": None,
                "steps_lost": None, "outcome": "not_injected", "error": ev.detail.get("error")}
    later = events[i + 1:]
    kind = ev.detail["drill"]
    if kind == DrillKind.SLOW_RANK:
        report = _slow_rank_report(ev, later)
    elif kind == DrillKind.COLLECTIVE_FAULT and not _failed_first(later):
        report = _collective_fault_report(ev, later)
    elif kind == DrillKind.STORAGE_OUTAGE:
        report = _outage_report(ev, later)
    else:
        report = _failure_report(ev, later)
    report = {"id": ev.detail.get("id"), "kind": kind, "target": ev.detail.get("target"),
              "at_step": ev.detail.get("step"), "injected_at": ev.time, **report}
    for name in PARAMS:
        if name in ev.detail:
            report[name] = ev.detail[name]
    origin = float(ev.detail.get("acts_at", ev.time))  # (a silent fault is made on the node a moment later)
    if "acts_at" in ev.detail:
        report["fault_at"] = origin
    if report.get("detected_at") is not None:
        report["detection_s"] = report["detected_at"] - origin
    if report.get("recovered_at") is not None:
        report["recovery_s"] = report["recovered_at"] - origin
    if kind in RIDDEN_OUT and report["outcome"] == "not_detected":
        report["outcome"] = "ridden_out"  # (the run ended with no failure declared: what these should give)
    return report


RIDDEN_OUT = (DrillKind.SLOW_LINK, DrillKind.LOSSY_LINK, DrillKind.PARTITION)
"""Kinds a run may ride out with no failure declared (a slow or lossy link, a short partition)."""


class DrillReports:
    """The drill reports of a growing timeline, kept up to date incrementally: new events are scanned
    once, and only reports whose outcome may still change are computed again."""

    def __init__(self) -> None:
        self._scanned = 0
        self._at: list[int] = []
        self._reports: list[dict[str, Any]] = []

    def of(self, events: list[Event]) -> list[dict[str, Any]]:
        if len(events) < self._scanned:  # a restored timeline
            self.__init__()  # type: ignore[misc]
        if len(events) == self._scanned:
            return list(self._reports)
        for i in range(self._scanned, len(events)):
            if events[i].kind in DRILL_EVENTS:
                self._at.append(i)
                self._reports.append({})
        self._scanned = len(events)
        for k, i in enumerate(self._at):
            if self._reports[k].get("outcome") not in FINAL_OUTCOMES:
                self._reports[k] = drill_report(events, i)
        return list(self._reports)


def spec_drill_id(run_id: str, index: int) -> str:
    """The spec's drills have ids fixed by run and position, so a restarted service knows them again."""
    return "drill-" + hashlib.sha256(f"{run_id}/{index}".encode()).hexdigest()[:8]


class RunDrills:
    """One run's drills: those still to inject (the spec's and requested ones, in one schedule), the
    one being injected, and the reports of those injected, from the run's timeline."""

    def __init__(self, run_id: str, spec_drills: "list[DrillSpec]") -> None:
        self.schedule = DrillSchedule([
            DrillRequest(id=spec_drill_id(run_id, i), kind=d.kind, at_step=d.at_step, target=d.target,
                         **{name: getattr(d, name) for name in PARAMS})
            for i, d in enumerate(spec_drills)])
        self._reports = DrillReports()
        self._injecting: DrillRequest | None = None
        """The drill being injected (outside the lock): out of the schedule, not yet in the timeline."""

    def pending(self) -> list[DrillRequest]:
        return self.schedule.pending()

    def find(self, drill_id: str) -> DrillRequest | None:
        return self.schedule.find(drill_id)

    def request(self, now: float, kind: str, *, step: int, placement: Placement | None,
                **params: Any) -> tuple[DrillRequest, dict[str, Any]]:
        """Validate and queue a drill on a live run at `step` (DrillError says what to fix): the request
        and its `drill_requested` event detail."""
        request = self.schedule.request(now, kind, step=step, placement=placement, **params)
        detail = request.to_dict()
        return request, {"drill": detail.pop("kind"), **detail}

    def restore(self, events: list[dict[str, Any]]) -> None:
        """After a restart: the drills requested and not injected yet are due again (the spec's too)."""
        done = {e["detail"].get("id") for e in events if e["kind"] in DRILL_EVENTS}
        requested = [DrillRequest(id=d["id"], kind=DrillKind(d["drill"]), at_step=d.get("at_step"),
                                  target=d.get("target"), requested_at=d.get("requested_at"),
                                  **{name: d.get(name) for name in PARAMS})
                     for e in events if e["kind"] == EventKind.DRILL_REQUESTED and (d := e["detail"]).get("id") not in done]
        self.schedule = DrillSchedule([r for r in self.schedule.pending() if r.id not in done] + requested)

    def reports(self, events: list[Event]) -> list[dict[str, Any]]:
        """Every injected (or refused) drill's report, kept up to date incrementally."""
        return self._reports.of(events)

    def lookup(self, drill_id: str, events: list[Event], *, ended: bool) -> dict[str, Any] | None:
        """A drill's report once injected; before that, the request with outcome `pending` (being
        injected) or `scheduled` (`not_injected` if the run ended first). None if no such drill."""
        report = next((r for r in self.reports(events) if r["id"] == drill_id), None)
        if report is not None:
            return report
        injecting = self._injecting
        if injecting is not None and injecting.id == drill_id:
            return {**injecting.to_dict(), "outcome": "pending"}
        request = self.schedule.find(drill_id)
        if request is None:
            return None
        return {**request.to_dict(), "outcome": "not_injected" if ended else "scheduled"}

    def inject_due(self, step: int, placement: Placement, injector: DrillInjector,
                   outside_lock: Callable[[], ContextManager[Any]]) -> list[tuple[EventKind, dict[str, Any]]]:
        """Inject every drill whose step has come, together (two drills at one step hit at once: a
        node and its buddy's node lost together): (drill_injected, what was hit) or (drill_failed,
        why) for each, for the timeline."""
        outcomes = []
        while (drill := self.schedule.pop_due(step)) is not None:
            outcomes.append(self._inject(drill, step, placement, injector, outside_lock))
        return outcomes

    def _inject(self, drill: DrillRequest, step: int, placement: Placement, injector: DrillInjector,
                outside_lock: Callable[[], ContextManager[Any]]) -> tuple[EventKind, dict[str, Any]]:
        asked = drill.target or default_target(drill.kind, placement)
        problem = target_problem(drill.kind, asked, placement)
        target = concrete_target(drill.kind, asked, placement)
        facts = {"id": drill.id, "drill": drill.kind, "target": target, "step": step,
                 **({"asked": asked} if asked != target else {}),
                 **{k: v for k, v in drill.to_dict().items() if k in PARAMS}}
        try:
            if problem is not None:
                raise DrillError(problem)
            self._injecting = drill  # a request for its report while it is injected finds it
            with outside_lock():
                detail = injector.inject(drill.kind, target, **drill.params())
        except Exception as e:  # noqa: BLE001 - a drill that cannot be injected is reported, not fatal
            return EventKind.DRILL_FAILED, {**facts, "error": str(e)}
        finally:
            self._injecting = None
        return EventKind.DRILL_INJECTED, {**facts, **detail}


def _first(events: list[Event], kind: str, **match: Any) -> Event | None:
    return next((e for e in events if e.kind == kind and all(e.detail.get(k) == v for k, v in match.items())), None)


def _ended(events: list[Event]) -> Event | None:
    return next((e for e in events if e.kind in (EventKind.FAILED, EventKind.CANCELLED, EventKind.SUCCEEDED)), None)


def _failure_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """kill-node, kill-rank, hang-rank, bitflip: detected as a failure, decided on, recovered."""
    detected = _first(later, EventKind.FAILURE_DETECTED)
    decision = _first(later, EventKind.DECISION)
    recovered = _first(later, EventKind.FIRST_STEP_AFTER_RECOVERY)
    restored = _first(later, EventKind.ATTEMPT_STARTED)
    ended = _ended(later)
    resumed_from = restored.detail.get("start_step", 0) if restored else None
    if detected is not None and detected.detail.get("replicas") is not None:
        # Only those replicas stopped: the survivors went on from the last step (the one in flight was
        # discarded), and the lost replicas took their state from a live one when they rejoined.
        lost = set(detected.detail["replicas"])
        rejoined = next((e for e in later if e.kind == EventKind.REPLICA_REJOINED
                         and lost <= set(e.detail.get("replicas", ()))), None)
        out = _first(later, EventKind.REPLICA_LOST)
        return {
            "survivors_told_at": out.detail.get("told_at") if out else None,
            "detected_at": detected.time, "cause": detected.detail.get("cause"),
            "attributed_to": {"nodes": detected.detail.get("nodes"), "ranks": detected.detail.get("ranks")},
            "decision": decision.detail.get("action") if decision else None,
            "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
            "recovery_heard_at": recovered.time if recovered else None,
            "steps_lost": max(0, ev.detail["step"] - detected.detail.get("step", ev.detail["step"])),
            "restored_from": "replica" if rejoined else None,
            "replicas": sorted(lost),
            "rejoined_at": rejoined.detail.get("at", rejoined.time) if rejoined else None,
            "outcome": _outcome(recovered is not None, True, ended.kind if ended else None),
        }
    return {
        "detected_at": detected.time if detected else None,
        "cause": detected.detail.get("cause") if detected else None,
        "attributed_to": ({"nodes": detected.detail.get("nodes"), "ranks": detected.detail.get("ranks")}
                          if detected else None),
        "decision": decision.detail.get("action") if decision else None,
        "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
        "recovery_heard_at": recovered.time if recovered else None,
        # From the step it was injected at back to the step the next attempt started from; none when
        # that is later (a bitflip lands at the rank's next step, and a snapshot of that step that the
        # probes vouch for is loaded).
        "steps_lost": max(0, ev.detail["step"] - resumed_from) if resumed_from is not None else None,
        "restored_from": restored.detail.get("restore_from") if restored else None,
        "outcome": _outcome(recovered is not None, detected is not None, ended.kind if ended else None),
    }


def _collective_fault_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """A collective between replicas failed with nothing lost: detected when a rank says its step
    was discarded, resolved by the epoch the controller published (`resync`), recovered at the
    replicas' first step after it. Nothing is redone but the discarded step. (A fault that became
    a failure after all is reported as one.)"""
    discarded = _first(later, EventKind.REPLICA_STEP_DISCARDED)
    resync = _first(later, EventKind.REPLICA_RESYNC)
    recovered = _first(later, EventKind.FIRST_STEP_AFTER_RECOVERY) if resync else None
    ended = _ended(later)
    if recovered is not None:
        outcome = "recovered"
    elif ended is None:
        outcome = "pending"
    elif ended.kind != EventKind.SUCCEEDED:
        outcome = "failed"
    elif resync is not None:  # (at the run's last step: no step after it)
        outcome = "recovered"
    else:  # a collective late by less than the timeout discards nothing: the run rides it out
        outcome = "ridden_out" if ev.detail.get("seconds") is not None else "not_detected"
    return {
        "detected_at": discarded.time if discarded else None,
        "cause": "collective" if discarded else None,
        "attributed_to": None,  # (each replica's first rank says its step was discarded: no culprit is named)
        "decision": "resync" if resync else None,
        "resynced_at": resync.time if resync else None,
        "recovered_at": recovered.detail.get("ended_at", recovered.time) if recovered else None,
        "recovery_heard_at": recovered.time if recovered else None,
        "steps_lost": 0 if recovered else None,
        "restored_from": None,
        "outcome": outcome,
    }


def _failed_first(later: list[Event]) -> bool:
    """Whether a failure was detected before any epoch resolved a discarded step."""
    for e in later:
        if e.kind == EventKind.REPLICA_RESYNC:
            return False
        if e.kind == EventKind.FAILURE_DETECTED:
            return True
    return False


def _slow_rank_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """Detected by the straggler verdict naming the rank; then either reported only, or its node
    replaced at the next checkpoint (no step lost)."""
    rank = int(ev.detail["target"])
    verdict = _first(later, EventKind.STRAGGLER, rank=rank)
    after = later[later.index(verdict) + 1:] if verdict else []
    detected = _first(after, EventKind.FAILURE_DETECTED, cause="straggler")
    decision = _first(after, EventKind.DECISION) if detected else None
    recovered = _first(after, EventKind.FIRST_STEP_AFTER_RECOVERY) if detected else None
    restored = _first(after, EventKind.ATTEMPT_STARTED) if detected else None
    ended = _ended(later)
    if verdict is None:
        outcome = "not_detected" if ended else "pending"
    elif detected is None:
        outcome = "detected"
    else:
        outcome = _outcome(recovered is not None, True, ended.kind if ended else None)
    return {
        "detected_at": verdict.time if verdict else None,
        "cause": "straggler" if verdict else None,
        "attributed_to": ({"nodes": [verdict.detail.get("node")], "ranks": [rank], "score": verdict.detail.get("score"),
                           "steps_to_verdict": verdict.detail.get("step", 0) - ev.detail["step"]}
                          if verdict else None),
        "decision": decision.detail.get("action") if decision else ("report" if verdict else None),
        "recovered_at": recovered.time if recovered else None,
        "steps_lost": (detected.detail.get("step", 0) - restored.detail.get("start_step", 0)
                       if detected and restored else 0),
        "outcome": outcome,
    }


def _outage_report(ev: Event, later: list[Event]) -> dict[str, Any]:
    """The outage shows as failed saves (unless retries outlast it); it is over at the first commit
    after it ends."""
    until = float(ev.detail.get("until", ev.time))
    failed = [e for e in later if e.kind == EventKind.CHECKPOINT_FAILED]
    committed = next((e for e in later if e.kind == EventKind.CHECKPOINT_COMMITTED and e.time >= until), None)
    ended = _ended(later)
    return {
        "detected_at": failed[0].time if failed else None,
        "cause": "storage_outage" if failed else None,
        "attributed_to": None,
        "decision": "retry",
        "saves_failed": [e.detail.get("step") for e in failed if committed is None or e.time <= committed.time],
        "recovered_at": committed.time if committed else None,
        "steps_lost": 0,
        "outcome": "recovered" if committed else ("not_recovered" if ended else "pending"),
    }


def _outcome(recovered: bool, detected: bool, ended: str | None) -> str:
    if recovered:
        return "recovered"
    if ended in (EventKind.FAILED, EventKind.CANCELLED):
        return "failed"
    if ended == "succeeded":  # the run ended before it noticed, or resumed at the last step
        return "recovered" if detected else "not_detected"
    return "pending"
