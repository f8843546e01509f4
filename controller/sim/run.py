"""`goodput simulate`: the real RunController — planner, placement, attribution, failure policy,
Young/Daly, goodput accounting — driven on a virtual clock by the simulated edge (controller.sim.group)
through a failure model and a cost model (controller.sim.model). Nothing in the controller knows it
is simulated. Pure: no ray, torch or boto3. Deterministic for a seed.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import statistics
from collections import Counter
from typing import Any

from controller.events import EventKind
from controller.drills import DrillKind
from checkpointing.store import MemoryStore
from controller.run_state import RunState
from controller.sim.cluster import SimCluster, VirtualClock, spare_topology
from controller.sim.group import SimWorkerGroup, judged_steps
from controller.sim.model import Incident, cost_model, incidents, mtbf_hours
from controller.spec import FailureModelSpec, RunSpec, SpecError, parse_spec
from controller.planner import plan_run
from controller.state import RunController

DEFAULT_DAYS = 54.0


class SimInjector:
    """The spec's drills (scripted failures) as incidents at the moment the controller injects them."""

    arms_ahead: frozenset[DrillKind] = frozenset()
    """(In the model a drill strikes at the step the controller injects it at.)"""

    def __init__(self, group: SimWorkerGroup, cluster: SimCluster, clock: VirtualClock, repair_s: float) -> None:
        self.group, self.cluster, self.clock, self.repair_s = group, cluster, clock, repair_s

    def inject(self, kind: DrillKind, target: str, *, factor: float | None = None, seconds: float | None = None,
               delay_ms: float | None = None, loss: float | None = None, point: str | None = None,
               from_step: int | None = None) -> dict[str, Any]:
        now = self.clock()
        assert self.group.attempt is not None
        placement = self.group.attempt.placement
        on_node = kind.target == "node"
        node = target if on_node else placement.node_of_rank[int(target)]
        if kind in (DrillKind.SLOW_LINK, DrillKind.LOSSY_LINK):
            return {"node": node}  # (the model has no slow or lossy links: a run rides them out)
        incident = Incident(time=now, component=kind.component, node=node, repair_s=self.repair_s if on_node else 0.0,
                            silent=kind.silent)  # a power-off, a partition, a frozen host: a node gone dark
        if on_node:
            self.cluster.take_down(node, now + self.repair_s)
        self.group.strike(incident, rank=None if on_node else int(target), factor=factor,
                          delay_s=seconds if kind is DrillKind.COLLECTIVE_FAULT else None)
        return {"node": node}


def simulate(spec: RunSpec, *, days: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Simulate the run for `days` (or until it ends); its accounting, failures, decisions and MTTR."""
    # A long run keeps millions of small objects (steps, events) and makes no reference cycles worth
    # collecting: the cyclic collector's full passes over them would cost more than the simulation.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(spec, days=days, seed=seed)
    finally:
        if enabled:
            gc.enable()


def _simulate(spec: RunSpec, *, days: float | None, seed: int) -> dict[str, Any]:
    sim = spec.cluster.simulated
    if sim is None:
        raise SpecError("goodput simulate needs cluster.simulated: {nodes, gpus_per_node, racks, spares}")
    clock = VirtualClock(0.0)
    topology = spare_topology(sim)
    cluster = SimCluster(topology, clock)
    plan, _ = plan_run(spec, topology)
    model = spec.to_model_config()
    params = model.num_params()
    cost = cost_model(spec, params=params, gpus=plan.mesh.world_size, gpus_per_node=sim.gpus_per_node,
                      flops_per_token=model.known_numbers().flops_per_token if model.provider else None,
                      replicas=plan.mesh.dp_replicas)
    failures = spec.failures or FailureModelSpec()
    horizon = (days if days is not None else DEFAULT_DAYS) * 86400.0
    planned = incidents(failures, [n.name for n in topology.nodes], horizon_s=horizon, seed=seed)
    slow = [(i.time, i.time + (i.repair_s or 86400.0), i.node) for i in planned if i.component == "straggler"]

    def slow_nodes(t: float) -> dict[str, float]:
        return {node: failures.straggler_factor for a, b, node in slow if a <= t < b}

    store = MemoryStore(clock)
    group = SimWorkerGroup(clock, cost, store, total_steps=spec.train.steps, slow_nodes=slow_nodes,
                           judged_steps=judged_steps(spec.health.straggler_steps))
    injector = SimInjector(group, cluster, clock, failures.repair_hours.host * 3600.0)
    c = RunController(spec, topology, group, now=0.0, checkpoint_store=store, run_id=spec.name, injector=injector,
                      topology_source=cluster.topology)
    struck: Counter[str] = Counter()
    pending = list(planned)
    heard: tuple[Any, ...] | None = None  # what the controller's action at the last commit it heard depended on
    waiting_since = 0.0
    while not c.state.terminal and clock.t < horizon:
        while pending and pending[0].time <= clock.t:
            incident = pending.pop(0)
            if incident.repair_s > 0 and (incident.lost_node or incident.component == "sdc"):
                cluster.take_down(incident.node, incident.time + incident.repair_s)
            if group.strike(incident):
                struck[incident.component] += 1
        due = [r.at_step for r in c.drills.pending() if r.at_step is not None]
        group.wake_at_step = min(due) if due else None
        before, commits = c.state, group.committed
        c.step(clock.t)
        if c.state is RunState.RUNNING and before is RunState.RUNNING:
            if group.committed != commits:
                heard = commit_inputs(c, cluster)
            wake = running_wake(c, group, cluster, heard, clock.t)
        elif c.state is RunState.RECOVERING:
            # waiting for capacity: what the controller decides changes when a node is back, or when the
            # wait is over
            waiting_since = clock.t if before is not RunState.RECOVERING else waiting_since
            repair = cluster.next_repair(clock.t)
            over = waiting_since + spec.elastic.wait_for_capacity_s
            wake = min(repair if repair is not None else math.inf, over if over > clock.t else clock.t + 10.0)
        else:
            continue  # planning and launching go on at once
        nxt = min(wake, pending[0].time if pending else math.inf, horizon)
        clock.t = max(nxt, clock.t)
        if nxt == math.inf:
            break
    if c.state is RunState.RUNNING and clock.t >= horizon:
        c.step(horizon)  # the steps and commits done by the horizon, heard (the last wake may be well before it)
    end = min(max(clock.t, c.finished_at or 0.0), horizon) if c.finished_at is None else c.finished_at
    goodput = c.goodput(end, fresh=True)
    events = [e.to_dict() for e in c.events]
    recoveries = [f["recovery_seconds"] for f in goodput["failures"] if f["recovery_seconds"] is not None]
    return {
        "run": spec.name, "state": c.state.value, "seed": seed, "days": horizon / 86400.0,
        "simulated_seconds": end, "steps": c.progress.step, "total_steps": spec.train.steps,
        "gpus": plan.mesh.world_size, "nodes": sim.nodes, "spares": sim.spares,
        "mesh": plan.mesh.axes(),
        "params": params, "cost_model": cost.to_dict(), "mtbf_hours": mtbf_hours(failures, sim.nodes),
        "checkpoint_every": _interval(events, spec),
        "incidents": len(planned), "incidents_by_component": dict(Counter(i.component for i in planned)),
        "silent_by_component": dict(Counter(i.component for i in planned if i.silent)),
        "interruptions_by_component": dict(struck),
        "failures_by_cause": dict(Counter(e["detail"]["cause"] for e in events if e["kind"] == EventKind.FAILURE_DETECTED)),
        "decisions": dict(Counter(e["detail"]["action"] for e in events if e["kind"] == EventKind.DECISION)),
        "mttr_s": statistics.mean(recoveries) if recoveries else None,
        "lost_per_failure": lost_per_failure(goodput["failures"]),
        "attempts": max(c.attempt, 0) + 1,
        "goodput": goodput,
        "ettr": goodput["ettr"],
        "_controller": c,
    }


def running_wake(c: RunController, group: SimWorkerGroup, cluster: SimCluster, heard: tuple[Any, ...] | None,
                 now: float) -> float:
    """The next moment a running controller has something to hear, as the poll left the group: the
    group's own (steps, signals, formed replicas) and the commits the controller may act on."""
    acts = c.acts_on_commits()
    if c.drills.pending() or group.judging is not None or (acts and not same_inputs(heard, commit_inputs(c, cluster))):
        group.commits_from = -math.inf  # (while the ranks' times are judged, a verdict may come at any poll)
    elif acts:  # what it would do changes once a node is back
        repair = cluster.next_repair(now)
        group.commits_from = repair if repair is not None else math.inf
    else:
        group.commits_from = math.inf
    wake = group.next_wake(now)
    if -math.inf < group.commits_from < math.inf:
        # the commits skipped until then are heard just before the node is back: with what they would
        # have been heard with, so none of them is acted on late
        before_back = math.nextafter(group.commits_from, -math.inf)
        wake = min(wake, before_back) if before_back > now else wake
    if c.replicas_out:  # replicas out for want of a node: the controller forms them once one is back
        repair = cluster.next_repair(now)
        wake = min(wake, repair if repair is not None else math.inf)
    return wake


def commit_inputs(c: RunController, cluster: SimCluster) -> tuple[Any, ...]:
    """What the controller's action at a commit depends on: growing back, its nodes and the cluster's
    (immutable topologies: a change is a new object) and its mesh; replacing a straggler, its verdicts
    and its spares. A commit heard with the inputs of the last one heard cannot make it act, so the
    group need not wake for it (at 131,072 GPUs a shrunk run's Young/Daly interval is one step)."""
    verdicts = frozenset(c.watch.stragglers.to_replace) if c.watch is not None else frozenset()
    return (c.topology, cluster.topology(), c.config, verdicts)


def same_inputs(a: tuple[Any, ...] | None, b: tuple[Any, ...]) -> bool:
    return a is not None and all(x is y for x, y in zip(a[:3], b[:3])) and a[3] == b[3]


LOST_TERMS = ("detection_seconds", "recovery_seconds", "restart_seconds", "restore_seconds", "waiting_seconds",
              "recomputation_seconds", "lost_seconds", "degraded_seconds")


def lost_per_failure(failures: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """By cause, and for all failures ("all"): how many, and the mean of each lost-work term per failure
    (detection, recovery: restart, restore and any wait for capacity, recomputation, and their sum;
    apart, degraded: what the next attempt's smaller mesh cost); "total": the sums over all failures.
    Failures not yet recovered count in detection and recomputation only."""
    out: dict[str, dict[str, float]] = {}
    for cause in sorted({f["cause"] for f in failures}) + ["all"]:
        these = [f for f in failures if cause in ("all", f["cause"])]
        if not these:
            continue
        row: dict[str, float] = {"count": len(these)}
        for term in LOST_TERMS:
            values = [f[term] for f in these if f.get(term) is not None]
            row[term] = statistics.fmean(values) if values else 0.0
        out[cause] = row
    if failures:
        out["total"] = {"count": len(failures), **{term: math.fsum(f[term] for f in failures if f.get(term) is not None)
                                                   for term in LOST_TERMS}}
    return out


def run_view(result: dict[str, Any]) -> dict[str, Any]:
    """The Run object of a simulation (events, history, drills, goodput at its end), as the service
    would show it: what `goodput simulate --out` draws. Built on demand (a 54-day run has long lists)."""
    c = result["_controller"]
    view = c.to_dict(result["simulated_seconds"])
    view["goodput"] = result["goodput"]
    return view


def _interval(events: list[dict[str, Any]], spec: RunSpec) -> Any:
    chosen = [e["detail"]["steps"] for e in events if e["kind"] == EventKind.CHECKPOINT_INTERVAL]
    if spec.checkpoint.every_steps == "auto":
        return {"auto": sorted(set(chosen))}
    return spec.checkpoint.every_steps


def fill(raw: dict[str, Any], base: dict[str, Any]) -> None:
    """Grow (or shrink) the data-parallel degree of `raw` to fill its simulated cluster's non-spare
    nodes, as `base` (the spec before the sweep) fills its own: tp and pp stay, the global batch keeps
    `base`'s samples per replica, min_dp keeps its share of dp. What a world-size sweep needs: more
    nodes train one model faster, not the same mesh with idle nodes beside it."""
    par = raw.get("parallelism")
    if not isinstance(par, dict):
        raise SpecError("--fill needs parallelism {dp, tp, pp} in the spec, not 'auto'")
    sim = raw.get("cluster", {}).get("simulated") or {}
    base_par = base.get("parallelism") or {}
    dp0 = int(base_par.get("dp", 1))
    per_replica = int(par.get("tp", 1)) * int(par.get("pp", 1))
    gpus = (int(sim.get("nodes", 0)) - int(sim.get("spares", 0))) * int(sim.get("gpus_per_node", 8))
    dp = gpus // per_replica
    if dp < 1:
        raise SpecError(f"--fill: {gpus} non-spare GPUs cannot hold one replica of tp x pp = {per_replica}")
    par["dp"] = dp
    train = raw.setdefault("train", {})
    batch0 = int((base.get("train") or {}).get("global_batch", train.get("global_batch", dp0)))
    train["global_batch"] = max(1, batch0 // dp0) * dp
    elastic = raw.get("elastic")
    if isinstance(elastic, dict) and "min_dp" in elastic:
        elastic["min_dp"] = max(1, int(elastic["min_dp"]) * dp // dp0)


def sweep(raw: dict[str, Any], axes: list[tuple[str, list[str]]], *, days: float | None, seed: int,
          fill_dp: bool = False) -> list[dict[str, Any]]:
    """Every combination of the axes' values (dotted keys into the spec), simulated with the same
    seed (the same incidents wherever the cluster is the same). A setting the cluster cannot hold (or
    the spec refuses) is that row's result: {state: infeasible, error, setting}. `fill_dp`: each
    setting's dp fills its cluster (`fill`; the row's `gpus` and `mesh` say what it came to)."""
    rows = []
    for values in itertools.product(*[vals for _, vals in axes]):
        variant = copy.deepcopy(raw)
        setting = {}
        for (key, _), value in zip(axes, values):
            _set(variant, key, _parse_value(value))
            setting[key] = _parse_value(value)
        try:
            if fill_dp:
                fill(variant, raw)
            result = simulate(parse_spec(variant), days=days, seed=seed)
        except SpecError as e:  # that setting's answer; the others still run
            result = {"state": "infeasible", "error": str(e)}
        result["setting"] = setting
        rows.append(result)
    return rows


def parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise SpecError(f"--sweep {text!r}: give KEY=V1,V2,... (e.g. checkpoint.every_steps=50,100,auto)")
    return key.strip(), [v.strip() for v in values.split(",") if v.strip()]


def _parse_value(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part, {}), dict):
            raise SpecError(f"--sweep {dotted}: {part} is not a section of the spec")
        node = node.setdefault(part, {})
    node[parts[-1]] = value
