"""What the CLI prints: events as sentences, tables, the run summary and simulation results, and the
one-line error a user can act on."""

from __future__ import annotations

import json
import sys
from typing import Any

from controller.events import EventKind
from controller.placement import recorded_nodes
from trainer.config import MeshAxis


class CliError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


QUIET_KINDS = frozenset({EventKind.CHECKPOINT_STAGED, EventKind.RESTORED, EventKind.PEER_SNAPSHOTS,
                         EventKind.REPLICA_READY, EventKind.REPLICA_CHECKSUMS})
"""Diagnostics the live views leave out: per-rank detail of a save, a restore, the first peer snapshot,
a replica's readiness and its final state's checksums (replicas that differ are said as the
`sdc_suspect` the controller makes of them; `goodput events` shows every one; `goodput run` writes
them to its out dir's events.log)."""


def describe(event: dict) -> str:
    d = event["detail"]
    kind = event["kind"]
    if kind == EventKind.PLANNED:
        return f"planned mesh {mesh_text(d['mesh'])}: {d['explanation']}"
    if kind == EventKind.ATTEMPT_STARTED:
        nodes = sorted(recorded_nodes(d["placement"]))
        if d.get("restore_from") == "peer":  # the step the peers' snapshots hold, no store read
            src = f"from peer snapshots of step {d.get('start_step')}"
        elif d.get("resume_step") is not None:
            src = f"from checkpoint step {d['resume_step']}"
        else:
            src = "from scratch"
        return f"attempt {event['attempt']} started on {nodes} {src}"
    if kind == EventKind.CHECKPOINT_COMMITTED:
        return f"checkpoint committed at step {d['step']} ({d['seconds']:.2f} s)"
    if kind == EventKind.DRILL_INJECTED:
        target = f" on {d['target']}" if d.get("target") is not None else ""
        return f"drill {d['drill']}{target} injected after step {d.get('step')}"
    if kind == EventKind.FAILURE_DETECTED:
        return f"failure detected: {d['cause']}: {d.get('message', '')}"
    if kind == EventKind.DECISION:
        return f"decision: {d['action']}: {d.get('reason', '')}"
    if kind == EventKind.FIRST_STEP_AFTER_RECOVERY:
        if d.get("survivors"):
            return f"recovered: the surviving replicas' first step is step {d['step']}"
        return f"recovered: first step of attempt {event['attempt']} is step {d['step']}"
    if kind == EventKind.REPLICA_LOST:
        return (f"replica(s) {d['replicas']} lost ({d['nodes']}); {d['live']} of {d['of']} train on, "
                f"{d['batch']}ing the global batch")
    if kind == EventKind.REPLICA_REJOINED:
        return (f"replica(s) {d['replicas']} rejoined at step {d['step']} with replica {d['source']}'s state "
                f"(survivors held {d['seconds']:.2f} s)")
    if kind == EventKind.CHECKPOINT_STAGED:
        return f"checkpoint of step {d['step']} staged (training blocked {d['blocked_s']:.3f} s)"
    if kind == EventKind.RESTORED:
        read = (f", reading {d['bytes_read'] / 2**20:.1f} MiB of its {d['bytes'] / 2**20:.1f} MiB"
                if d.get("bytes") else "")
        return f"rank {d.get('rank')} restored step {d['step']}{read}"
    if kind == EventKind.RESTORE_FAILED:
        return f"restoring step {d['step']} failed: {d['error']}"
    if kind == EventKind.STRAGGLER:
        return (f"straggler: rank {d['rank']} on {d['node']} computes {d['score']:.2f}x "
                f"({d['basis']}) at step {d['step']}; action {d['action']}")
    if kind == EventKind.SDC_SUSPECT:
        evidence = "; ".join(f"rank {r}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
                             for r, v in (d.get("evidence") or {}).items())
        return f"silent data corruption suspected on ranks {d['ranks']} at step {d['step']}: {evidence}"
    if kind == EventKind.QUARANTINED:
        return f"node {d['node']} quarantined ({d['reason']})"
    if kind == EventKind.CHECKPOINT_FAILED:
        return f"checkpoint at step {d['step']} failed: {d['error']}"
    if kind == EventKind.CHECKPOINT_SKIPPED:
        return f"checkpoint of step {d['step']} not written: {d['reason']}"
    if kind == EventKind.DRILL_REQUESTED:
        when = f"at step {d['at_step']}" if d.get("at_step") is not None else "at the next step"
        target = f" on {d['target']}" if d.get("target") is not None else ""
        return f"drill {d['drill']}{target} requested ({d.get('id')}), {when}"
    if kind == EventKind.DRILL_FAILED:
        return f"drill {d.get('drill')} could not be injected: {d.get('error')}"
    if kind == EventKind.RUN_ID_CHOSEN:
        return f"run id {d['run_id']}: {d['reason']}"
    if kind == EventKind.RESUME_REQUESTED:
        src = f"step {d['step']}" if d.get("step") is not None else "its latest checkpoint"
        return f"resume requested from {src} (to step {d.get('steps')})"
    if kind == EventKind.REPLICA_STEP_DISCARDED:  # (the collective's own error is in `goodput events`)
        return f"step {d.get('step')} discarded by replica of rank {d.get('rank')}: a replica failed in it, nothing applied"
    if kind == EventKind.CHECKPOINT_DISCARDED:
        return f"checkpoint of step {d['step']} discarded: {d['reason']}"
    if kind == EventKind.CHECKPOINT_UNUSABLE:
        return f"a checkpoint is unusable: {d['reason']}"
    if kind == EventKind.STORE_UNAVAILABLE:
        return f"checkpoint store unreachable since {clock(d.get('since'))}, retrying in {d.get('retry_in_s', 0):.0f} s: {d['error']}"
    if kind == EventKind.STORE_AVAILABLE:
        return f"checkpoint store reachable again after {d.get('down_s', 0):.0f} s"
    if kind == EventKind.SERVICE_RESTARTED:
        return f"service restarted (run was {d.get('previous_state')}): {d.get('action')}"
    return f"{kind.replace('_', ' ')}: " + ", ".join(f"{k} {value_text(k, v)}" for k, v in d.items())


def mesh_text(mesh: dict | None) -> str:
    return "-" if not mesh else " x ".join(f"{axis}{mesh[axis]}" for axis in (a.value for a in MeshAxis) if axis in mesh)


def clock(t: float | None) -> str:
    import time

    return "?" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def value_text(key: str, value: Any) -> str:
    """An event detail as a person reads it: Unix times as clock times, floats rounded."""
    if isinstance(value, float) and (key.endswith("_at") or key in ("since", "until", "time")):
        return clock(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {value_text(k, v)}" for k, v in value.items()) + ")"
    return str(value)


def when(t: float | None) -> str:
    import time

    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def recoveries(events: list[dict]) -> dict[str, int]:
    """Recoveries by where the next attempt's state came from: peer, store, scratch."""
    out: dict[str, int] = {}
    failed = False
    for e in events:
        if e["kind"] == EventKind.FAILURE_DETECTED:
            failed = True
        elif e["kind"] == EventKind.ATTEMPT_STARTED and failed:
            source = e["detail"].get("restore_from") or "scratch"
            out[source] = out.get(source, 0) + 1
            failed = False
    return out


def run_summary(run: dict) -> dict:
    history = run.get("history") or []
    return {
        "name": run["name"], "state": run["state"], "steps": run["step"], "attempts": run["attempt"] + 1,
        "mesh": run["mesh"], "first_loss": history[0]["loss"] if history else None, "final_loss": run["loss"],
        "ettr": run["goodput"]["ettr"],
        "badput_seconds": {k: round(v, 2) for k, v in run["goodput"]["badput_seconds"].items()},
        "checkpoints": sum(1 for e in run["events"] if e["kind"] == EventKind.CHECKPOINT_COMMITTED),
        "recovered from": recoveries(run["events"]),
        "health": {str(kind): n for kind, n in (run.get("health") or {}).get("counts", {}).items() if n},
        "quarantined": [f"{q['node']} ({q['reason']})" for q in run.get("quarantined", [])],
        **{f"drill {i + 1}": (f"{d['kind']} {d['target']} at step {d['at_step']}: {d['cause']} -> {d['decision']}, "
                              f"detected in {d.get('detection_s', float('nan')):.1f} s, first step after "
                              f"{d.get('recovery_s', float('nan')):.1f} s, {d['steps_lost']} steps redone"
                              f"{', from ' + d['restored_from'] if d.get('restored_from') else ''}, {d['outcome']}") for i, d in enumerate(run.get("drills", []))},
    }


def sweep_cells(r: dict) -> list[Any]:
    if r["state"] == "infeasible":
        return ["infeasible", "-", "-", "-", "-", "(below)"]
    return [f"{r['ettr']:.4f}", f"{r['steps']}/{r['total_steps']}", sum(r["failures_by_cause"].values()),
            "-" if r["mttr_s"] is None else f"{r['mttr_s']:.0f}", interval_text(r["checkpoint_every"]),
            largest_badput(r["goodput"]["badput_seconds"], r["goodput"]["wall_seconds"])]


def interval_text(value: Any) -> str:
    if isinstance(value, dict):
        return "auto " + ",".join(str(v) for v in value.get("auto", [])[:3])
    return str(value)


def largest_badput(badput: dict, wall: float) -> str:
    name, seconds = max(badput.items(), key=lambda kv: kv[1])
    return f"{name} {seconds / wall:.2%}" if wall else "-"


def print_simulation(r: dict) -> None:
    g = r["goodput"]
    print(f"{r['run']}: {r['state']} after {r['simulated_seconds'] / 86400:.2f} simulated days, step "
          f"{r['steps']}/{r['total_steps']}, {r['gpus']} GPUs (mesh dp{r['mesh']['dp']} pp{r['mesh']['pp']} "
          f"tp{r['mesh']['tp']}), {r['spares']} spare node(s), {r['attempts']} attempt(s)")
    print(f"ETTR {r['ettr']:.4f}; model MTBF {r['mtbf_hours']:.2f} h; checkpoint every {interval_text(r['checkpoint_every'])}"
          f" step(s); MTTR {'-' if r['mttr_s'] is None else format(r['mttr_s'], '.1f') + ' s'}")
    print("cost model: " + ", ".join(f"{k} {v:.3g}" for k, v in r["cost_model"].items()))
    print()
    table(["category", "seconds", "share"],
           [["productive", f"{g['productive_seconds']:.0f}", f"{g['ettr']:.2%}"]]
           + [[k, f"{v:.0f}", f"{v / g['wall_seconds']:.2%}" if g["wall_seconds"] else "-"]
              for k, v in g["badput_seconds"].items()])
    print()
    print("incidents: " + (", ".join(f"{k} {v}" for k, v in sorted(r["incidents_by_component"].items())) or "none")
          + f"; interrupting the run: {sum(r['interruptions_by_component'].values())}")
    print("failures by cause: " + (", ".join(f"{k} {v}" for k, v in sorted(r["failures_by_cause"].items())) or "none"))
    print("decisions: " + (", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items())) or "none"))
    if r.get("lost_per_failure"):
        print()
        print("lost per failure (mean seconds; total: the sums over the run; lost = detection + restart + restore"
              " + waiting for capacity + recomputation; degraded: the next attempt's training on a smaller mesh, at"
              " the throughput it lacked):")
        terms = ("detection", "restart", "restore", "waiting", "recomputation", "lost", "degraded")
        table(["cause", "count", *terms],
              [[cause, f"{row['count']:.0f}", *(f"{row[f'{t}_seconds']:.1f}" for t in terms)]
               for cause, row in r["lost_per_failure"].items()])
