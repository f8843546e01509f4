"""`goodput` command line. Thin: parse, call a service, print. Imports no Ray or torch at import time
so `goodput --help` is instant; every command takes --json and fails with one clear line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from controller.cli.client import DEFAULT_HOST, DEFAULT_PORT
from controller.drills import DrillKind
from controller.events import EventKind
from controller.ray.cluster import ClusterError
from controller.spec import SpecError, load_spec
from trainer.config import MeshAxis


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
    from controller.ray.runner import run_foreground
    from controller.service.app import ApiBindError
    from controller.state import RunController
    from controller.cli.ui import ProgressView

    out_dir = Path(opts.out_dir or f"goodput-out/{spec.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with ProgressView(spec.name, spec.train.steps, quiet=opts.json) as view:
        seen = [0]

        def on_tick(c: RunController) -> None:
            if not seen[0]:  # the cluster is up: say once where its own output goes
                view.note(f"Ray's own logs go to {out_dir}/ (ray-driver.log, ray-processes.log)")
            for event in list(c.events)[seen[0]:]:
                if event.kind not in QUIET_KINDS:
                    view.note(_describe(event.to_dict()))
            seen[0] = len(c.events)
            if c.progress.history:
                view.update(c.progress, attempt=max(c.attempt, 0))

        api = _api_address(opts.api or DEFAULT_API)
        token, token_file = _api_token(api[0]) if api is not None else (None, None)

        def on_api(url: str) -> None:
            where = f"; token in {token_file}" if token_file else ""
            view.note(f"API on {url} (goodput status|drill {spec.name}; GOODPUT_URL={url}{where})")

        # Ray's own messages (a raylet's death notice with its state dump, for one) print to sys.stdout
        # from its threads, and its processes write their own output: both go to the run's log
        # directory. The terminal shows goodput's account of what happened; stdout keeps the result.
        ray_log = out_dir / "ray-driver.log"
        with open(ray_log, "a") as ray_out, contextlib.redirect_stdout(ray_out):
            try:
                run = run_foreground(spec, on_tick=on_tick, api=api, api_any_port=opts.api is None, on_api=on_api,
                                     token=token, log_dir=str(out_dir))
            except ApiBindError as e:
                raise CliError(f"{e.strerror}; give --api HOST:PORT with a free port (0 picks one) "
                               "or --api off") from None
    if opts.json:
        _emit_json(run)
    else:
        ProgressView.print_summary(_summary(run))
    if opts.report != "off":
        from controller.cli import report

        path = report.plot(report.build(run, run["events"], run["history"]),
                           Path(opts.report or out_dir / "timeline.png"))
        print(f"goodput: timeline and goodput breakdown in {path} (goodput report {run['id']} while the API "
              "serves the run)", file=sys.stderr if opts.json else sys.stdout)
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


def _api_token(host: str) -> tuple[str, Any]:
    """The API's token: GOODPUT_TOKEN, else the token file under the state dir (made on first use,
    0600). Serving beyond loopback needs an explicit token."""
    import os

    from controller.service.auth import TOKEN_ENV, default_state_dir
    from controller.service.auth import AuthConfigError, check_bind, ensure_token

    explicit = os.environ.get(TOKEN_ENV) or None
    try:
        check_bind(host, explicit)
        token, path, made = ensure_token(default_state_dir(), explicit)
    except AuthConfigError as e:
        raise CliError(str(e)) from None
    return token, path


QUIET_KINDS = frozenset({EventKind.CHECKPOINT_STAGED, EventKind.RESTORED})
"""Events the live views leave out (`goodput events` shows every one)."""


def _describe(event: dict) -> str:
    d = event["detail"]
    kind = event["kind"]
    if kind == EventKind.PLANNED:
        return f"planned mesh {_mesh(d['mesh'])}: {d['explanation']}"
    if kind == EventKind.ATTEMPT_STARTED:
        nodes = sorted({r["node"] for r in d["placement"]})
        src = f"from checkpoint step {d['resume_step']}" if d.get("resume_step") is not None else "from scratch"
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
        return f"recovered: first step of attempt {event['attempt']} is step {d['step']}"
    if kind == EventKind.CHECKPOINT_STAGED:
        return f"checkpoint of step {d['step']} staged (training blocked {d['blocked_s']:.3f} s)"
    if kind == EventKind.RESTORED:
        return f"rank {d.get('rank')} restored step {d['step']}"
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
    if kind == EventKind.CHECKPOINT_DISCARDED:
        return f"checkpoint of step {d['step']} discarded: {d['reason']}"
    if kind == EventKind.CHECKPOINT_UNUSABLE:
        return f"a checkpoint is unusable: {d['reason']}"
    if kind == EventKind.STORE_UNAVAILABLE:
        return f"checkpoint store unreachable since {_clock(d.get('since'))}, retrying in {d.get('retry_in_s', 0):.0f} s: {d['error']}"
    if kind == EventKind.STORE_AVAILABLE:
        return f"checkpoint store reachable again after {d.get('down_s', 0):.0f} s"
    if kind == EventKind.SERVICE_RESTARTED:
        return f"service restarted (run was {d.get('previous_state')}): {d.get('action')}"
    return f"{kind.replace('_', ' ')}: " + ", ".join(f"{k} {_value(k, v)}" for k, v in d.items())


def _mesh(mesh: dict | None) -> str:
    return "-" if not mesh else " x ".join(f"{axis}{mesh[axis]}" for axis in (a.value for a in MeshAxis) if axis in mesh)


def _clock(t: float | None) -> str:
    import time

    return "?" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def _value(key: str, value: Any) -> str:
    """An event detail as a person reads it: Unix times as clock times, floats rounded."""
    if isinstance(value, float) and (key.endswith("_at") or key in ("since", "until", "time")):
        return _clock(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {_value(k, v)}" for k, v in value.items()) + ")"
    return str(value)


def _summary(run: dict) -> dict:
    history = run.get("history") or []
    return {
        "name": run["name"], "state": run["state"], "steps": run["step"], "attempts": run["attempt"] + 1,
        "mesh": run["mesh"], "first_loss": history[0]["loss"] if history else None, "final_loss": run["loss"],
        "ettr": run["goodput"]["ettr"],
        "badput_seconds": {k: round(v, 2) for k, v in run["goodput"]["badput_seconds"].items()},
        "checkpoints": sum(1 for e in run["events"] if e["kind"] == EventKind.CHECKPOINT_COMMITTED),
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
    from controller.cli.ui import ProgressView

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
               "mesh": mesh.axes(), **progress.summary(),
               "history": progress.history}
    if opts.json:
        _emit_json(summary)
    else:
        ProgressView.print_summary(summary)
    if code != 0:
        raise CliError(f"training exited with code {code}")
    return 0


def cmd_plan(opts: argparse.Namespace) -> int:
    from controller.ray.runner import plan_local

    spec = load_spec(opts.spec)
    if spec.cluster.address:
        raise CliError("goodput plan reads cluster.local; for a live cluster submit the run instead")
    plan, placement = plan_local(spec)
    mesh = plan.mesh
    out: dict[str, Any] = {"mesh": mesh.axes(), "ranks": list(placement.rows()),
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
    if opts.uri is None:
        return _checkpoints_from_service(opts)
    return _checkpoints_from_store(opts)


def _checkpoints_from_service(opts: argparse.Namespace) -> int:
    with _api() as client:
        rows = client.call("GET", f"/v1/runs/{opts.run}/checkpoints")
    if opts.json:
        _emit_json(rows)
        return 0
    if not rows:
        print(f"no committed checkpoints for run {opts.run!r}")
    _table(["step", "attempt", "MiB", "save s", "committed", "uri"],
           [[r["step"], r["attempt"], f"{(r.get('bytes') or 0) / 2**20:.1f}", f"{r.get('seconds') or 0:.2f}",
             _when(r["committed_at"]), r.get("uri") or ""] for r in rows])
    return 0


def _checkpoints_from_store(opts: argparse.Namespace) -> int:
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
    from controller.cli.client import ApiClientError, Client

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
        if opts.watch:
            run = _watch(client, run)
    if opts.json:
        _emit_json(run)
        return 0
    mesh = run["mesh"] or {}
    print(f"{run['id']}: {run['state']}, step {run['step']}, loss {run['loss']}, attempt {run['attempt']}, "
          f"mesh dp{mesh.get('dp')} pp{mesh.get('pp')} tp{mesh.get('tp')}, ETTR {run['goodput']['ettr']:.2f}")
    if run.get("waiting_for"):
        print(f"  pending: {run['waiting_for']}")
    goodput = run["goodput"]
    lost = sorted(((k, v) for k, v in goodput["badput_seconds"].items() if v >= 0.05), key=lambda kv: -kv[1])
    print(f"  goodput: {goodput['productive_seconds']:.1f} s productive of {goodput['wall_seconds']:.1f} s; badput: "
          + (", ".join(f"{k} {v:.1f} s" for k, v in lost) or "none"))
    for d in run.get("drills", []):
        print(f"  {d['id']}: {d['kind']} {d['target']} at step {d['at_step']} -> {d['outcome']}")
    if run.get("error"):
        print(f"  error: {run['error']['message']}")
    return 0


def _watch(client: Any, run: dict) -> dict:
    """Follow a run live (the progress bar of `goodput run`, events as they come) until it ends; the
    final Run object."""
    import time

    from controller.cli.ui import ProgressView

    after = -1
    with ProgressView(run["id"], run.get("total_steps") or 1, quiet=False) as view:
        while True:
            for event in client.call("GET", f"/v1/runs/{run['id']}/events", params={"after": after}):
                after = event["seq"]
                if event["kind"] not in QUIET_KINDS:
                    view.note(_describe(event))
            if run["step"]:
                view.show(run["step"], run.get("total_steps") or run["step"], run["loss"], run["attempt"])
            if run["state"] in ("succeeded", "failed", "cancelled"):
                return run
            time.sleep(0.5)
            run = client.call("GET", f"/v1/runs/{run['id']}")


def cmd_submit(opts: argparse.Namespace) -> int:
    spec = load_spec(opts.spec)
    with _api() as client:
        run = client.call("POST", "/v1/runs", spec.model_dump(mode="json", exclude_unset=True))
        if opts.watch:
            run = _watch(client, run)
    if opts.json:
        _emit_json(run)
    else:
        print(f"{run['id']}: {run['state']}" + (f" ({run['waiting_for']})" if run.get("waiting_for") else "")
              + (f"; checkpoints in {run['checkpoint_uri']}/{run['id']}" if run.get("checkpoint_uri") else ""))
    if opts.watch and run["state"] != "succeeded":
        raise CliError(f"run {run['id']} {run['state']}: {(run.get('error') or {}).get('message', 'see events')}")
    return 0


def cmd_list(opts: argparse.Namespace) -> int:
    with _api() as client:
        runs = client.call("GET", "/v1/runs")
    if opts.json:
        _emit_json(runs)
        return 0
    if not runs:
        print("no runs")
        return 0
    _table(["run", "state", "step", "loss", "attempt", "mesh", "created", "note"],
           [[r["id"], r["state"], f"{r['step']}/{r.get('total_steps', '?')}",
             "" if r["loss"] is None else f"{r['loss']:.4f}", r["attempt"],
             "" if not r["mesh"] else f"dp{r['mesh']['dp']} pp{r['mesh']['pp']} tp{r['mesh']['tp']}",
             _when(r["created_at"]), r.get("waiting_for") or (r.get("error") or {}).get("message", "")]
            for r in runs])
    return 0


def _all_events(client: Any, run: str) -> list[dict]:
    events: list[dict] = []
    after = -1
    while True:
        page = client.call("GET", f"/v1/runs/{run}/events", params={"after": after})
        events.extend(page)
        if len(page) < 1000:
            return events
        after = page[-1]["seq"]


def cmd_events(opts: argparse.Namespace) -> int:
    with _api() as client:
        events = _all_events(client, opts.run)
    if opts.json:
        _emit_json(events)
        return 0
    for e in events:
        print(f"{_when(e['time'])}  attempt {e['attempt']}  {_describe(e)}")
    return 0


ENDED = ("succeeded", "failed", "cancelled")


def cmd_cancel(opts: argparse.Namespace) -> int:
    """Cancel, then wait until the run has stopped (its GPUs free, resumable) unless --no-wait."""
    import time

    with _api() as client:
        run = client.call("POST", f"/v1/runs/{opts.run}/cancel")  # on an ended run: changes nothing
        already = run["state"] in ENDED
        deadline = time.monotonic() + opts.timeout
        while not already and not opts.no_wait and run["state"] not in ENDED:
            if time.monotonic() > deadline:
                raise CliError(f"{run['id']} is still {run['state']} {opts.timeout:.0f} s after the cancel; "
                               f"see `goodput status {run['id']}`")
            time.sleep(0.3)
            run = client.call("GET", f"/v1/runs/{opts.run}")
    if opts.json:
        _emit_json(run)
    elif already:
        raise CliError(f"{run['id']} had already ended ({run['state']}); nothing was cancelled "
                       f"(goodput resume {run['id']} starts it again)")
    elif run["state"] in ENDED:
        print(f"{run['id']}: {run['state']} at step {run['step']}; goodput resume {run['id']} goes on from its "
              "latest checkpoint")
    else:
        print(f"{run['id']}: cancel requested ({run['state']})")
    return 0


def cmd_resume(opts: argparse.Namespace) -> int:
    body = {k: v for k, v in (("step", opts.step), ("steps", opts.steps)) if v is not None}
    with _api() as client:
        run = client.call("POST", f"/v1/runs/{opts.run}/resume", body)
        if opts.watch:
            run = _watch(client, run)
    if opts.json:
        _emit_json(run)
    elif opts.watch:
        print(f"{run['id']}: {run['state']}, step {run['step']}/{run.get('total_steps')}")
    else:
        src = f"step {opts.step}" if opts.step is not None else "its latest checkpoint"
        print(f"{run['id']}: resumes from {src} ({run['state']})")
    if opts.watch and run["state"] != "succeeded":
        raise CliError(f"run {run['id']} {run['state']}: {(run.get('error') or {}).get('message', 'see events')}")
    return 0


def cmd_serve(opts: argparse.Namespace) -> int:
    from controller.service.auth import default_state_dir
    from controller.service.auth import AuthConfigError
    from controller.service.main import ServeOptions, serve_forever

    try:
        return serve_forever(ServeOptions(
            host=opts.host, port=opts.port, state_dir=opts.state_dir or default_state_dir(), db=opts.db,
            address=opts.address, local_nodes=opts.local_nodes, gpus_per_node=opts.gpus_per_node, racks=opts.racks,
            spares=opts.spares, gpu_memory_gb=opts.gpu_memory_gb, kubernetes=opts.kubernetes,
            rack_label=opts.rack_label, domain_label=opts.domain_label, advertise_host=opts.advertise_host,
            repair_after_s=opts.repair_after_s))
    except AuthConfigError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(str(e)) from None


def _when(t: float | None) -> str:
    import time

    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_report(opts: argparse.Namespace) -> int:
    from controller.cli import report

    with _api() as client:
        run = client.call("GET", f"/v1/runs/{opts.run}")
        events = _all_events(client, opts.run)
        history: list[dict] = []
        while True:
            page = client.call("GET", f"/v1/runs/{opts.run}/history",
                               params={"after": history[-1]["step"] if history else -1})
            history.extend(page)
            if len(page) < 10000:
                break
    data = report.build(run, events, history)
    path = report.plot(data, Path(opts.out or f"{opts.run}-timeline.png"))
    if opts.json:
        _emit_json({**{k: v for k, v in data.items() if k not in ("events", "history")}, "png": str(path)})
    else:
        print(report.table(data))
        print(f"\ntimeline: {path}")
    return 0


def cmd_nodes(opts: argparse.Namespace) -> int:
    if opts.action == "release" and not opts.node:
        raise CliError("give the node to release: goodput nodes release NODE")
    with _api() as client:
        if opts.action == "release":
            released = client.call("POST", f"/v1/nodes/{opts.node}/release")
            if opts.json:
                _emit_json(released)
            else:
                print(f"{released['name']}: released as a {'spare' if released['state'] == 'spare' else 'training node'} "
                      f"(was {released['was']['state']}: {released['was']['reason']})")
                if released.get("kubernetes"):
                    print(f"  kubernetes: {released['kubernetes']}")
            return 0
        view = client.call("GET", "/v1/nodes")
    if opts.json:
        _emit_json(view)
        return 0
    _table(["node", "state", "rack", "gpus", "run", "since", "reason"],
           [[n["name"], n["state"], n["rack"] or "-", n["gpus"], n["run"] or "-", _clock(n.get("since"))
             if n.get("since") else "-", n["reason"] or ""] for n in view["nodes"]])
    print(f"{view['free_gpus']} of {view['gpus']} GPU(s) free")
    return 0


def cmd_k8s_node_labels(opts: argparse.Namespace) -> int:
    from controller.k8s.labels import write_labels
    from controller.k8s.nodes import KubeError

    node = opts.node or os.environ.get("NODE_NAME")
    if not node:
        raise CliError("give --node (or NODE_NAME from the downward API's spec.nodeName)")
    try:
        labels = write_labels(node, Path(opts.out), rack_label=opts.rack_label, domain_label=opts.domain_label or None,
                              spare=opts.spare or bool(opts.spare_group and os.environ.get("RAY_GROUP") == opts.spare_group),
                              url=opts.api_url, token=os.environ.get("KUBE_TOKEN"))
    except KubeError as e:
        raise CliError(str(e)) from None
    print(f"ray labels for {node}: {labels} -> {opts.out}")
    return 0


def cmd_simulate(opts: argparse.Namespace) -> int:
    import time

    import yaml as _yaml

    from controller.sim.run import parse_sweep, simulate, sweep
    from controller.spec import parse_spec

    try:
        raw = _yaml.safe_load(Path(opts.spec).read_text())
    except (OSError, _yaml.YAMLError) as e:
        raise CliError(f"cannot read {opts.spec}: {e}") from None
    started = time.perf_counter()
    if opts.sweep:
        rows = sweep(raw, [parse_sweep(s) for s in opts.sweep], days=opts.days, seed=opts.seed)
    else:
        rows = [simulate(parse_spec(raw), days=opts.days, seed=opts.seed)]
    wall = time.perf_counter() - started
    if opts.out:
        from controller.cli import report

        if opts.sweep:
            report.plot_sweep(rows, Path(opts.out))
        else:
            c = rows[0]["_controller"]
            view = c.to_dict(rows[0]["simulated_seconds"])
            view["goodput"] = rows[0]["goodput"]
            report.plot(report.build(view, view["events"], view["history"]), Path(opts.out))
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    if opts.json:
        _emit_json(public if opts.sweep else public[0])
        return 0
    if not opts.sweep:
        _print_simulation(public[0])
    else:
        keys = list(public[0]["setting"])
        _table(keys + ["ETTR", "steps", "interruptions", "MTTR s", "ckpt every", "largest badput"],
               [[str(r["setting"][k]) for k in keys] + _sweep_cells(r) for r in public])
        for r in public:
            if r["state"] == "infeasible":
                print(f"{', '.join(f'{k}={v}' for k, v in r['setting'].items())}: infeasible: {r['error']}")
    drawn = f"; {'sweep' if opts.sweep else 'timeline'}: {opts.out}" if opts.out else ""
    print(f"\n{len(rows)} simulation(s) in {wall:.1f} s{drawn}")
    return 0


def _sweep_cells(r: dict) -> list[Any]:
    if r["state"] == "infeasible":
        return ["infeasible", "-", "-", "-", "-", "(below)"]
    return [f"{r['ettr']:.4f}", f"{r['steps']}/{r['total_steps']}", sum(r["failures_by_cause"].values()),
            "-" if r["mttr_s"] is None else f"{r['mttr_s']:.0f}", _every(r["checkpoint_every"]),
            _largest(r["goodput"]["badput_seconds"], r["goodput"]["wall_seconds"])]


def _every(value: Any) -> str:
    if isinstance(value, dict):
        return "auto " + ",".join(str(v) for v in value.get("auto", [])[:3])
    return str(value)


def _largest(badput: dict, wall: float) -> str:
    name, seconds = max(badput.items(), key=lambda kv: kv[1])
    return f"{name} {seconds / wall:.2%}" if wall else "-"


def _print_simulation(r: dict) -> None:
    g = r["goodput"]
    print(f"{r['run']}: {r['state']} after {r['simulated_seconds'] / 86400:.2f} simulated days, step "
          f"{r['steps']}/{r['total_steps']}, {r['gpus']} GPUs (mesh dp{r['mesh']['dp']} pp{r['mesh']['pp']} "
          f"tp{r['mesh']['tp']}), {r['spares']} spare node(s), {r['attempts']} attempt(s)")
    print(f"ETTR {r['ettr']:.4f}; model MTBF {r['mtbf_hours']:.2f} h; checkpoint every {_every(r['checkpoint_every'])}"
          f" step(s); MTTR {'-' if r['mttr_s'] is None else format(r['mttr_s'], '.1f') + ' s'}")
    print("cost model: " + ", ".join(f"{k} {v:.3g}" for k, v in r["cost_model"].items()))
    print()
    _table(["category", "seconds", "share"],
           [["productive", f"{g['productive_seconds']:.0f}", f"{g['ettr']:.2%}"]]
           + [[k, f"{v:.0f}", f"{v / g['wall_seconds']:.2%}" if g["wall_seconds"] else "-"]
              for k, v in g["badput_seconds"].items()])
    print()
    print("incidents: " + (", ".join(f"{k} {v}" for k, v in sorted(r["incidents_by_component"].items())) or "none")
          + f"; interrupting the run: {sum(r['interruptions_by_component'].values())}")
    print("failures by cause: " + (", ".join(f"{k} {v}" for k, v in sorted(r["failures_by_cause"].items())) or "none"))
    print("decisions: " + (", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items())) or "none"))


def cmd_dashboards_push(opts: argparse.Namespace) -> int:
    from controller.cli.dashboards import DEFAULT_DIR, PushError, push

    if not opts.token:
        raise CliError("give --token (or GRAFANA_TOKEN): a Grafana service-account token with the Editor role")
    try:
        pushed = push(opts.url.rstrip("/"), opts.token, Path(opts.dir) if opts.dir else DEFAULT_DIR)
    except PushError as e:
        raise CliError(str(e)) from None
    if opts.json:
        print(json.dumps(pushed, indent=2))
    else:
        for board in pushed:
            print(f"{board['title']}: version {board['version']} at {opts.url.rstrip('/')}{board['url'] or ''}")
    return 0


def _repair_delay(text: str) -> float | None:
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds (e.g. 5) or off") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be >= 0 (or off)")
    return value


def build_parser() -> argparse.ArgumentParser:
    from controller.service.main import EMBEDDED_CLUSTER

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
    run.add_argument("--out-dir", help="the run's logs and report (default goodput-out/NAME)")
    run.add_argument("--report", metavar="PNG", help="write the timeline plot here at the end (default "
                                                    "OUT_DIR/timeline.png); off: none")
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", help="show mesh, rank -> node map and memory per GPU without running")
    plan.add_argument("spec")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)
    ckpts = sub.add_parser("checkpoints", help="committed checkpoints of a run: size, age, mesh, verification")
    ckpts.add_argument("run")
    ckpts.add_argument("--uri", help="read the object store directly (the run spec's checkpoint.uri) and verify "
                                     "every file; default: ask the service")
    ckpts.add_argument("--quick", action="store_true", help="with --uri: check sizes only, not sha256")
    ckpts.add_argument("--json", action="store_true")
    ckpts.set_defaults(func=cmd_checkpoints)
    drill = sub.add_parser("drill", help="inject a failure into a running run and report how it recovered")
    drill.add_argument("run")
    drill.add_argument("kind", choices=[k.value for k in DrillKind],
                       help="; ".join(f"{k}: {k.effect}" for k in DrillKind))
    drill.add_argument("--target", help="node name (kill-node) or rank number; default: the last rank")
    drill.add_argument("--at-step", type=int, help="inject once this step is done; default: now")
    drill.add_argument("--factor", type=float, help="slow-rank: how many times slower (default 1.5)")
    drill.add_argument("--seconds", type=float, help="storage-outage: how long writes are refused (default 30)")
    drill.add_argument("--no-wait", action="store_true", help="return once scheduled, without the report")
    drill.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the report")
    drill.add_argument("--json", action="store_true")
    drill.set_defaults(func=cmd_drill)
    status = sub.add_parser("status", help="state, step, loss, mesh and drills of a run")
    status.add_argument("run")
    status.add_argument("--watch", action="store_true", help="follow the run live until it ends")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    serve = sub.add_parser("serve", help="start the controller service (REST API) on one Ray cluster")
    serve.add_argument("--host", default=DEFAULT_HOST)
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--state-dir", help="registry, token and logs (default $GOODPUT_STATE_DIR or ~/.goodput)")
    serve.add_argument("--db", help="SQLAlchemy URL of the registry (default SQLite under --state-dir), e.g. "
                                    "postgresql+psycopg://user@host/goodput")
    serve.add_argument("--address", help="join this Ray cluster (ray://HOST:PORT, HOST:PORT, auto) instead of "
                                         "starting an embedded one")
    serve.add_argument("--local-nodes", type=int, default=EMBEDDED_CLUSTER["nodes"],
                       help="embedded cluster: nodes (default: make run's cluster, examples/tiny-gpt.yaml)")
    serve.add_argument("--gpus-per-node", type=int, default=EMBEDDED_CLUSTER["gpus_per_node"],
                       help="embedded cluster: GPU slots per node")
    serve.add_argument("--racks", type=int, default=EMBEDDED_CLUSTER["racks"], help="embedded cluster: racks")
    serve.add_argument("--spares", type=int, default=EMBEDDED_CLUSTER["spares"],
                       help="embedded cluster: hot-spare nodes")
    serve.add_argument("--gpu-memory-gb", type=float, default=80.0, help="embedded cluster: memory per GPU slot")
    serve.add_argument("--repair-after-s", type=_repair_delay, default=5.0, metavar="S|off",
                       help="embedded cluster: a node a drill killed comes back this long after, as a repaired "
                            "node does (default 5; off: it stays lost)")
    serve.add_argument("--advertise-host", default="127.0.0.1",
                       help="this host's address as the training ranks reach it (their rendezvous store); on "
                            "Kubernetes the controller pod's IP")
    serve.add_argument("--kubernetes", choices=["auto", "on", "off"], default="auto",
                       help="quarantine cordons and taints the Kubernetes node, racks come from node labels "
                            "(auto: when running in a pod with a service account)")
    serve.add_argument("--rack-label", default="topology.kubernetes.io/zone",
                       help="Kubernetes node label that names a node's rack")
    serve.add_argument("--domain-label", default="nvidia.com/gpu.clique",
                       help="Kubernetes node label of a multi-node NVLink domain; it groups before the rack label "
                            "('' : none)")
    serve.set_defaults(func=cmd_serve)
    submit = sub.add_parser("submit", help="submit SPEC.yaml to the service")
    submit.add_argument("spec")
    submit.add_argument("--watch", action="store_true", help="follow the run until it ends")
    submit.add_argument("--json", action="store_true")
    submit.set_defaults(func=cmd_submit)
    lst = sub.add_parser("list", help="the service's runs, oldest first")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=cmd_list)
    events = sub.add_parser("events", help="a run's timeline")
    events.add_argument("run")
    events.add_argument("--json", action="store_true")
    events.set_defaults(func=cmd_events)
    cancel = sub.add_parser("cancel", help="cancel a run (in any state); its GPUs are freed")
    cancel.add_argument("run")
    cancel.add_argument("--no-wait", action="store_true", help="return once asked, not once the run has stopped")
    cancel.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the run to stop")
    cancel.add_argument("--json", action="store_true")
    cancel.set_defaults(func=cmd_cancel)
    resume = sub.add_parser("resume", help="start an ended run again from its latest (or a given) checkpoint")
    resume.add_argument("run")
    resume.add_argument("--step", type=int, help="committed step to start from (newer commits are discarded)")
    resume.add_argument("--steps", type=int, help="train to this many steps in all")
    resume.add_argument("--watch", action="store_true", help="follow the run until it ends")
    resume.add_argument("--json", action="store_true")
    resume.set_defaults(func=cmd_resume)
    nodes = sub.add_parser("nodes", help="the service's nodes and their states; release a quarantined one")
    nodes.add_argument("action", nargs="?", choices=["list", "release"], default="list")
    nodes.add_argument("node", nargs="?", help="with release: the node to release")
    nodes.add_argument("--json", action="store_true")
    nodes.set_defaults(func=cmd_nodes)
    k8s_labels = sub.add_parser("k8s-node-labels", help="(a Ray worker pod's init container) write the Ray node "
                                                        "labels of this pod's Kubernetes node for ray start --labels-file")
    k8s_labels.add_argument("--node", help="Kubernetes node name (default $NODE_NAME)")
    k8s_labels.add_argument("--out", required=True, help="YAML file to write")
    k8s_labels.add_argument("--rack-label", default="topology.kubernetes.io/zone")
    k8s_labels.add_argument("--domain-label", default="nvidia.com/gpu.clique")
    k8s_labels.add_argument("--spare", action="store_true", help="this worker group holds hot spares")
    k8s_labels.add_argument("--spare-group", help="hot spares when the pod's KubeRay group ($RAY_GROUP, the "
                                                  "ray.io/group label) is this one")
    k8s_labels.add_argument("--api-url", help="API server URL (default: the pod's service account)")
    k8s_labels.set_defaults(func=cmd_k8s_node_labels)
    simulate = sub.add_parser("simulate", help="the real controller on a virtual clock: a long run at scale "
                                               "through a failure model (cluster.simulated, failures:, cost:)")
    simulate.add_argument("spec")
    simulate.add_argument("--days", type=float, help="simulated days (default 54)")
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                          help="simulate each value of a spec key (dotted), e.g. checkpoint.every_steps=50,100,auto; "
                               "several --sweep: every combination")
    simulate.add_argument("--out", metavar="PNG", help="draw the run's timeline (not with --sweep)")
    simulate.add_argument("--json", action="store_true")
    simulate.set_defaults(func=cmd_simulate)
    rep = sub.add_parser("report", help="goodput/badput breakdown of a run and its timeline plot (PNG)")
    rep.add_argument("run")
    rep.add_argument("--out", help="where the PNG goes (default RUN-timeline.png)")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=cmd_report)
    boards = sub.add_parser("dashboards", help="Grafana dashboards (dashboards/grafana)")
    boards_sub = boards.add_subparsers(dest="action", required=True)
    push = boards_sub.add_parser("push", help="upload the dashboards into Grafana's goodput folder")
    push.add_argument("--url", required=True, help="Grafana's base URL, e.g. http://127.0.0.1:3000")
    push.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                      help="a service-account token with the Editor role (default $GRAFANA_TOKEN)")
    push.add_argument("--dir", help="folder of dashboard JSON (default: dashboards/grafana of this checkout)")
    push.add_argument("--json", action="store_true")
    push.set_defaults(func=cmd_dashboards_push)
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
