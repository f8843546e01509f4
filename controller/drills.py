"""Failure-injection drills: the kinds and their parameters, what each may target, the injector
protocol and the schedule of drills still to inject. A drill comes from the spec's `drills:` list or is
requested on a running run (`goodput drill RUN KIND`, `POST /v1/runs/{id}/drills`); both go through the
same schedule (controller/run_drills.py: one run's drills), and each injected drill's report is a pure
function of the run's events (controller/drill_reports.py)."""

from __future__ import annotations

import enum
import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from controller.placement import Placement
from trainer.protocol import PROTOCOL_POINTS

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
    # A planned departure with notice: the node's training processes get a SIGTERM (a spot VM reclaimed, a
    # Kubernetes eviction), and `seconds` later (the grace period) the node dies like kill-node.
    SPOT_RECLAIM = "spot-reclaim"

    @property
    def target(self) -> str:
        """`node`, `rank` or `store` (the run's object store: no target to give)."""
        if self.silent:
            return "node"
        return {"kill-node": "node", "spot-reclaim": "node", "storage-outage": "store"}.get(self.value, "rank")

    @property
    def silent(self) -> bool:
        """Whether it is a silent fault (a node's network or every process of it; nothing closes)."""
        return self.value in ("power-off", "partition", "slow-link", "lossy-link", "freeze-node")

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters this kind takes (of PARAMS)."""
        return {"slow-rank": ("factor",), "storage-outage": ("seconds",), "partition": ("seconds",),
                "freeze-node": ("seconds",), "slow-link": ("delay_ms",), "lossy-link": ("loss",),
                "collective-fault": ("point", "seconds"), "spot-reclaim": ("seconds",)}.get(self.value, ())

    def default(self, param: str) -> float | str | None:
        """A parameter's default (None for partition's and freeze-node's `seconds`: they last; for
        collective-fault's: the collective fails instead of coming late)."""
        defaults: dict[tuple[str, str], float | str] = {
            ("slow-rank", "factor"): DEFAULT_FACTOR, ("storage-outage", "seconds"): DEFAULT_OUTAGE_S,
            ("slow-link", "delay_ms"): DEFAULT_DELAY_MS, ("lossy-link", "loss"): DEFAULT_LOSS,
            ("collective-fault", "point"): DEFAULT_POINT, ("spot-reclaim", "seconds"): DEFAULT_GRACE_S}
        return defaults.get((self.value, param))

    @property
    def component(self) -> str:
        """What it fails, in the failure model's words (controller.sim)."""
        return {"kill-node": "host", "kill-rank": "rank", "hang-rank": "hang", "bitflip": "sdc",
                "slow-rank": "straggler", "storage-outage": "storage-outage", "power-off": "host",
                "partition": "host", "slow-link": "network", "lossy-link": "network",
                "freeze-node": "host", "collective-fault": "collective",
                "spot-reclaim": "host"}[self.value]  # (the model has no notice: a host lost)

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
                                    "too slow); failure_domain: replica",
                "spot-reclaim": "SIGTERM the node's training processes, SIGKILL the node `seconds` later (a spot "
                                "VM's notice, an eviction's grace period): the run leaves it at a step boundary"}[self.value]

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
DEFAULT_GRACE_S = 30.0
"""spot-reclaim: seconds between the SIGTERM and the node's end (GKE's spot notice; AWS gives 120)."""
DEFAULT_POINT = "reduce"
"""collective-fault: the gradient all-reduce between replicas."""
PARAMS = ("factor", "seconds", "delay_ms", "loss", "point")
"""Every drill parameter (DrillKind.params says which a kind takes)."""


class DrillInjector(Protocol):
    arms_ahead: frozenset[DrillKind]
    """Kinds it hands to their target before their step comes, to act from the step after it (the
    controller hears of a step a poll after it ends; a rank knows it at once): empty for most."""

    def inject(self, kind: DrillKind, target: str, *, factor: float | None = None, seconds: float | None = None,
               delay_ms: float | None = None, loss: float | None = None, point: str | None = None,
               from_step: int | None = None) -> dict[str, Any]:
        """Do it (`DrillKind.effect`) and say what was hit; `from_step`: for a kind in `arms_ahead`,
        the step from which it acts."""
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

    def pop_due(self, step: int, ahead: frozenset[DrillKind] = frozenset()) -> DrillRequest | None:
        """The next drill whose step has come, or of a kind in `ahead` (the injector hands it over now,
        to act at its step), removed from the schedule."""
        for i, request in enumerate(self._pending):
            if request.at_step is None or request.at_step <= step or request.kind in ahead:
                return self._pending.pop(i)
        return None

    def find(self, drill_id: str) -> DrillRequest | None:
        return next((r for r in self._pending if r.id == drill_id), None)

    def pending(self) -> list[DrillRequest]:
        return list(self._pending)


def spec_drill_id(run_id: str, index: int) -> str:
    """The spec's drills have ids fixed by run and position, so a restarted service knows them again."""
    return "drill-" + hashlib.sha256(f"{run_id}/{index}".encode()).hexdigest()[:8]
