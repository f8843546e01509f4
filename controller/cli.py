"""`goodput` command line. Thin: parse, call a service, print. Imports no Ray or torch at import time
so `goodput --help` is instant; every command takes --json and fails with one clear line."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable, Iterator

from controller.client import DEFAULT_HOST, DEFAULT_PORT
from controller.ray_cluster import ClusterError
from controller.spec import SpecError, load_spec


DEFAULT_API = f"{DEFAULT_HOST}:{DEFAULT_PORT}"


class CliError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


def _emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def cmd_run(opts: argparse.Namespace) -> int:
    spec = load_spec(opts.spec)
    if opts.launcher == "torchrun":
        return _run_torchrun(spec, opts)
    from controller.api import ApiBindError
    from controller.runner import run_foreground
    from controller.state import RunController
    from controller.ui import ProgressView

    with ProgressView(spec.name, spec.train.steps, quiet=opts.json) as view:
        seen = [0]

        def on_tick(c: RunController) -> None:
            for event in list(c.events)[seen[0]:]:
                view.note(_describe(event.to_dict()))
            seen[0] = len(c.events)
            if c.progress.history:
                view.update(c.progress, attempt=max(c.attempt, 0))

        def on_api(url: str) -> None:
            view.note(f"API on {url} (goodput status|drill {spec.name}; GOODPUT_URL={url})")

        # Ray's own messages (a raylet's death notice, for one) print to sys.stdout from its threads;
        # stdout is kept for the final result alone, so while the run lasts they go to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            try:
                run = run_foreground(spec, on_tick=on_tick, api=_api_address(opts.api or DEFAULT_API),
                                     api_any_port=opts.api is None, on_api=on_api)
            except ApiBindError as e:
                raise CliError(f"{e.strerror}; give --api HOST:PORT with a free port (0 picks one) "
                               "or --api off") from None
    if opts.json:
        _emit_json(run)
    else:
        ProgressView.print_summary(_summary(run))
    if run["state"] != "succeeded":
        error = run.get("error") or {}
        raise CliError(f"run {run['state']}: {error.get('message', 'see events')}")
    return 0


def _api_address(value: str) -> tuple[str, int] | None:
    if value == "off":
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise CliError(f"--api {value!r}: give HOST:PORT (port 0 picks a free one) or off")
    return host, int(port)


def _describe(event: dict) -> str:
    d = event["detail"]
    kind = event["kind"]
    if kind == "planned":
        return f"planned mesh {d['mesh']}: {d['explanation']}"
    if kind == "attempt_started":
        nodes = sorted({r["node"] for r in d["placement"]})
        src = f"from checkpoint step {d['resume_step']}" if d.get("resume_step") is not None else "from scratch"
        return f"attempt {event['attempt']} started on {nodes} {src}"
    if kind == "checkpoint_committed":
        return f"checkpoint committed at step {d['step']} ({d['seconds']:.2f} s)"
    if kind == "restored":
        return f"rank {d.get('rank')} restored step {d['step']}"
    if kind == "straggler":
        return (f"straggler: rank {d['rank']} on {d['node']} computes {d['score']:.2f}x "
                f"({d['basis']}) at step {d['step']}; action {d['action']}")
    if kind == "sdc_suspect":
        return f"silent data corruption suspected on ranks {d['ranks']} at step {d['step']}: {d['evidence']}"
    if kind == "quarantined":
        return f"node {d['node']} quarantined ({d['reason']})"
    if kind == "checkpoint_failed":
        return f"checkpoint at step {d['step']} failed: {d['error']}"
    return f"{kind} {d}"


def _summary(run: dict) -> dict:
    history = run.get("history") or []
    return {
        "name": run["name"], "state": run["state"], "steps": run["step"], "attempts": run["attempt"] + 1,
        "mesh": run["mesh"], "first_loss": history[0]["loss"] if history else None, "final_loss": run["loss"],
        "ettr": run["goodput"]["ettr"],
        "badput_seconds": {k: round(v, 2) for k, v in run["goodput"]["badput_seconds"].items()},
        "checkpoints": sum(1 for e in run["events"] if e["kind"] == "checkpoint_committed"),
        "health": {kind: n for kind, n in (run.get("health") or {}).get("counts", {}).items() if n},
        "quarantined": [f"{q['node']} ({q['reason']})" for q in run.get("quarantined", [])],
        **{f"drill {i + 1}": (f"{d['kind']} {d['target']} at step {d['at_step']}: {d['cause']} -> {d['decision']}, "
                              f"detected in {d.get('detection_s', float('nan')):.1f} s, first step after "
                              f"{d.get('recovery_s', float('nan')):.1f} s, {d['steps_lost']} steps redone, "
                              f"{d['outcome']}") for i, d in enumerate(run.get("drills", []))},
    }


def _run_torchrun(spec: Any, opts: argparse.Namespace) -> int:
    """The plain torchrun path (no controller, no fault tolerance), kept to prove the worker
    entry point is launcher-agnostic."""
    from controller.progress import RunProgress
    from controller.torchrun_launch import run_with_torchrun
    from controller.ui import ProgressView

    mesh = spec.fixed_mesh()
    if mesh is None:
        raise CliError("--launcher torchrun needs a fixed mesh: give parallelism: {dp, tp, pp}")
    config = spec.trainer_config(mesh)
    progress = RunProgress()
    with ProgressView(spec.name, config.train.steps, quiet=opts.json) as view:
        def on_report(report: Any) -> None:
            if progress.add(report):
                view.update(progress)

        code = run_with_torchrun(config, on_report)
    summary = {"name": spec.name, "state": "succeeded" if code == 0 else "failed",
               "mesh": {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}, **progress.summary(),
               "history": progress.history}
    if opts.json:
        _emit_json(summary)
    else:
        ProgressView.print_summary(summary)
    if code != 0:
        raise CliError(f"training exited with code {code}")
    return 0


def cmd_plan(opts: argparse.Namespace) -> int:
    from controller.runner import plan_local

    spec = load_spec(opts.spec)
    if spec.cluster.address:
        raise CliError("goodput plan reads cluster.local; for a live cluster submit the run instead")
    plan, placement = plan_local(spec)
    mesh = plan.mesh
    out: dict[str, Any] = {"mesh": {"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}, "ranks": list(placement.rows()),
           "spares": list(placement.spares), "memory_per_gpu_bytes": plan.memory_per_gpu_bytes,
           "explanation": plan.explanation}
    if opts.json:
        _emit_json(out)
        return 0
    print(f"mesh: dp{mesh.dp} x pp{mesh.pp} x tp{mesh.tp} = {mesh.world_size} ranks")
    print(f"memory per GPU: {plan.memory_per_gpu_bytes / 2**20:,.1f} MiB "
          f"({plan.static_bytes_per_gpu / 2**20:,.1f} MiB static + "
          f"{plan.activation_bytes_per_gpu / 2**20:,.1f} MiB activations)")
    print(f"why: {plan.explanation}")
    print(f"spares: {', '.join(placement.spares) or 'none'}")
    print("rank  dp  pp  tp  node        rack     gpu")
    for r in out["ranks"]:
        print(f"{r['rank']:>4}  {r['dp']:>2}  {r['pp']:>2}  {r['tp']:>2}  {r['node']:<10}  {r['rack']:<7}  {r['gpu']:>3}")
    return 0


def cmd_checkpoints(opts: argparse.Namespace) -> int:
    import time

    from checkpointing.manifest import CheckpointError, committed_steps, read_manifest, verify
    from checkpointing.store import StoreError, open_store

    try:
        store = open_store(opts.uri)
        rows = []
        for step in committed_steps(store, opts.run):
            row: dict[str, Any] = {"step": step}
            try:
                m = read_manifest(store, opts.run, step)
                row.update(attempt=m.attempt, mesh=m.mesh, world_size=m.world_size, cursor=m.cursor,
                           bytes=m.total_bytes(), files=len(m.files), age_s=round(time.time() - m.created_at, 1))
                verify(store, m, checksums=not opts.quick)
                row["verification"] = "sizes ok" if opts.quick else "verified"
            except CheckpointError as e:
                row["verification"] = f"unusable: {e}"
            rows.append(row)
    except StoreError as e:
        raise CliError(str(e)) from None
    if opts.json:
        _emit_json(rows)
        return 0
    if not rows:
        print(f"no committed checkpoints for run {opts.run!r} under {store.uri}")
    for r in rows:
        mesh = r.get("mesh") or {}
        print(f"step {r['step']:>8}  {r.get('bytes', 0) / 2**20:>9.1f} MiB  age {r.get('age_s', 0):>9.0f} s  "
              f"mesh dp{mesh.get('dp')} pp{mesh.get('pp')} tp{mesh.get('tp')}  attempt {r.get('attempt')}  "
              f"{r['verification']}")
    return 0


@contextlib.contextmanager
def _api() -> Iterator[Any]:
    """A client of the run's API (GOODPUT_URL); its failures become one-line CLI errors."""
    from controller.client import ApiClientError, Client

    client = Client()
    try:
        yield client
    except ApiClientError as e:
        raise CliError(str(e)) from None
    finally:
        client.close()


def cmd_drill(opts: argparse.Namespace) -> int:
    """Inject a drill into a running run through its API; wait for the report unless --no-wait."""
    import time

    with _api() as client:
        body = {"kind": opts.kind, "target": opts.target, "at_step": opts.at_step}
        body |= {k: v for k, v in (("factor", opts.factor), ("seconds", opts.seconds)) if v is not None}
        drill = client.call("POST", f"/v1/runs/{opts.run}/drills", body)
        deadline = time.monotonic() + opts.timeout
        while not opts.no_wait and drill["outcome"] in ("scheduled", "pending"):
            if time.monotonic() > deadline:
                raise CliError(f"drill {drill['id']} is still {drill['outcome']} after {opts.timeout:.0f} s; "
                               f"see `goodput status {opts.run}`")
            time.sleep(0.5)
            drill = client.call("GET", f"/v1/drills/{drill['id']}")
    if opts.json:
        _emit_json(drill)
    elif drill["outcome"] == "scheduled":
        when = f"after step {drill['at_step']}" if drill.get("at_step") is not None else "now"
        print(f"{drill['id']}: {drill['kind']} on run {opts.run} scheduled {when}")
    else:
        print(f"{drill['id']}: {drill['kind']} {drill.get('target')} at step {drill.get('at_step')} -> "
              f"{drill['outcome']}")
        for key in ("cause", "attributed_to", "decision", "detection_s", "recovery_s", "steps_lost", "error"):
            if drill.get(key) is not None:
                value = drill[key]
                print(f"  {key:<14} {value:.2f} s" if key.endswith("_s") else f"  {key:<14} {value}")
    if drill["outcome"] not in ("recovered", "scheduled", "detected"):
        raise CliError(f"drill {drill['id']} ended {drill['outcome']}; see `goodput status {opts.run}`")
    return 0


def cmd_status(opts: argparse.Namespace) -> int:
    with _api() as client:
        run = client.call("GET", f"/v1/runs/{opts.run}")
    if opts.json:
        _emit_json(run)
        return 0
    mesh = run["mesh"] or {}
    print(f"{run['id']}: {run['state']}, step {run['step']}, loss {run['loss']}, attempt {run['attempt']}, "
          f"mesh dp{mesh.get('dp')} pp{mesh.get('pp')} tp{mesh.get('tp')}, ETTR {run['goodput']['ettr']:.2f}")
    for d in run.get("drills", []):
        print(f"  {d['id']}: {d['kind']} {d['target']} at step {d['at_step']} -> {d['outcome']}")
    if run.get("error"):
        print(f"  error: {run['error']['message']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodput", description="Fault-tolerant LLM training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run SPEC.yaml in this process on the embedded local cluster")
    run.add_argument("spec")
    run.add_argument("--json", action="store_true", help="print the final run as one JSON document")
    run.add_argument("--launcher", choices=["ray", "torchrun"], default="ray",
                     help="ray: the fault-tolerant controller (default); torchrun: plain torchrun, no controller")
    run.add_argument("--api", metavar="HOST:PORT",
                     help=f"serve the REST API here while the run lasts, for goodput drill/status (default "
                          f"{DEFAULT_API}, or a free port if that one is taken); off: none")
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", help="show mesh, rank -> node map and memory per GPU without running")
    plan.add_argument("spec")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)
    ckpts = sub.add_parser("checkpoints", help="committed checkpoints of a run: size, age, mesh, verification")
    ckpts.add_argument("run")
    ckpts.add_argument("--uri", default="file://./goodput-runs", help="the run spec's checkpoint.uri")
    ckpts.add_argument("--quick", action="store_true", help="check sizes only, not sha256")
    ckpts.add_argument("--json", action="store_true")
    ckpts.set_defaults(func=cmd_checkpoints)
    drill = sub.add_parser("drill", help="inject a failure into a running run and report how it recovered")
    drill.add_argument("run")
    drill.add_argument("kind", choices=["kill-node", "kill-rank", "hang-rank", "slow-rank", "bitflip",
                                        "storage-outage"])
    drill.add_argument("--target", help="node name (kill-node) or rank number; default: the last rank")
    drill.add_argument("--at-step", type=int, help="inject once this step is done; default: now")
    drill.add_argument("--factor", type=float, help="slow-rank: how many times slower (default 1.5)")
    drill.add_argument("--seconds", type=float, help="storage-outage: how long writes are refused (default 30)")
    drill.add_argument("--no-wait", action="store_true", help="return once scheduled, without the report")
    drill.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the report")
    drill.add_argument("--json", action="store_true")
    drill.set_defaults(func=cmd_drill)
    status = sub.add_parser("status", help="state, step, loss, mesh and drills of a running run")
    status.add_argument("run")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> None:
    opts = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = opts.func
    try:
        code = func(opts)
    except (SpecError, CliError, ClusterError) as e:
        print(f"goodput: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("goodput: cancelled", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
