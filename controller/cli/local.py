"""Commands that work on this machine without a service: run (the embedded cluster, the API while it
lasts), plan, the store's own checkpoint listing, serve, simulate, and the deployment helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from controller.cli.client import DEFAULT_HOST, DEFAULT_PORT
from controller.cli.render import (QUIET_KINDS, CliError, clock, describe, emit_json, print_simulation, run_summary,
                                   sweep_cells, table)
from controller.spec import load_spec


DEFAULT_API = f"{DEFAULT_HOST}:{DEFAULT_PORT}"


class _RayLoggerTo:
    """Ray's driver-side messages (its "ray" logger: an errored task result dropped unread, a
    reconnect) go to `stream` instead of the terminal, from `take()` (once the cluster is up: ray is
    imported only then, after the run has set the environment it must be imported under) to `give_back()`."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.saved: list[Any] | None = None

    def take(self) -> None:
        import logging

        if self.saved is not None or "ray" not in sys.modules:
            return
        logger = logging.getLogger("ray")
        self.saved = logger.handlers[:]
        handler = logging.StreamHandler(self.stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.handlers = [handler]

    def give_back(self) -> None:
        import logging

        if self.saved is not None:
            logging.getLogger("ray").handlers = self.saved
            self.saved = None


def cmd_run(opts: argparse.Namespace) -> int:
    spec = load_spec(opts.spec)
    if opts.launcher == "torchrun":
        return _run_torchrun(spec, opts)
    from controller.service.main import run_foreground
    from controller.errors import ApiBindError
    from controller.state import RunController
    from controller.cli.ui import ProgressView

    out_dir = Path(opts.out_dir or f"goodput-out/{spec.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Ray's own messages (a raylet's death notice with its state dump, for one) print to sys.stdout
    # from its threads, and its processes write their own output: both go to the run's log
    # directory. The terminal shows goodput's account of what happened; stdout keeps the result.
    with ProgressView(spec.name, spec.train.steps, quiet=opts.json) as view, \
            open(out_dir / "events.log", "w") as events_log, open(out_dir / "ray-driver.log", "a") as ray_out:
        seen = [0]
        ray_logger = _RayLoggerTo(ray_out)

        def on_tick(c: RunController) -> None:
            if not seen[0]:  # the cluster is up: say once where its own output goes
                ray_logger.take()
                view.note(f"every event in {out_dir}/events.log; Ray's own logs there too (ray-driver.log, "
                          "ray-processes.log)")
            for event in list(c.events)[seen[0]:]:
                line = describe(event.to_dict())
                events_log.write(f"{clock(event.time)} attempt {event.attempt} [{event.kind}] {line} | "
                                 f"{json.dumps(event.detail, default=str)}\n")
                if event.kind not in QUIET_KINDS:
                    view.note(line)
            events_log.flush()
            seen[0] = len(c.events)
            if c.progress.history:
                view.update(c.progress, attempt=max(c.attempt, 0))

        api = _api_address(opts.api or DEFAULT_API)
        token, token_file = _api_token(api[0]) if api is not None else (None, None)

        def on_api(url: str) -> None:
            where = f"; token in {token_file}" if token_file else ""
            view.note(f"API on {url} (goodput status|drill {spec.name}; GOODPUT_URL={url}{where})")

        with contextlib.redirect_stdout(ray_out):
            try:
                run = run_foreground(spec, on_tick=on_tick, api=api, api_any_port=opts.api is None, on_api=on_api,
                                     token=token, log_dir=str(out_dir))
            except ApiBindError as e:
                raise CliError(f"{e.strerror}; give --api HOST:PORT with a free port (0 picks one) "
                               "or --api off") from None
            finally:
                ray_logger.give_back()
    if opts.json:
        emit_json(run)
    else:
        ProgressView.print_summary(run_summary(run))
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
        emit_json(summary)
    else:
        ProgressView.print_summary(summary)
    if code != 0:
        raise CliError(f"training exited with code {code}")
    return 0


def _model_numbers(spec: Any) -> Any:
    """A provider model's numbers, asked of its code (goodput plan and simulate plan with them)."""
    from controller.providers import with_model_numbers
    from controller.spec import SpecError

    try:
        return with_model_numbers(spec)
    except SpecError as e:
        raise CliError(str(e)) from None


def _with_provider_numbers(raw: Any) -> Any:
    """`raw` with its provider's numbers written in (a sweep parses each variant of it again)."""
    from controller.spec import SpecError, parse_spec

    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or not model.get("provider"):
        return raw
    try:
        numbers = _model_numbers(parse_spec(raw)).model.numbers
    except SpecError as e:
        raise CliError(str(e)) from None
    return {**raw, "model": {**model, "numbers": numbers.model_dump()}}


def cmd_plan(opts: argparse.Namespace) -> int:
    from controller.planner import plan_local

    spec = _model_numbers(load_spec(opts.spec))
    if spec.cluster.address:
        raise CliError("goodput plan reads cluster.local; for a live cluster submit the run instead")
    plan, placement = plan_local(spec)
    mesh = plan.mesh
    out: dict[str, Any] = {"mesh": mesh.axes(), "ranks": list(placement.rows()),
           "spares": list(placement.spares), "memory_per_gpu_bytes": plan.memory_per_gpu_bytes,
           "explanation": plan.explanation}
    if opts.json:
        emit_json(out)
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


def checkpoints_from_store(opts: argparse.Namespace) -> int:
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
        emit_json(rows)
        return 0
    if not rows:
        print(f"no committed checkpoints for run {opts.run!r} under {store.uri}")
    for r in rows:
        mesh = r.get("mesh") or {}
        print(f"step {r['step']:>8}  {r.get('bytes', 0) / 2**20:>9.1f} MiB  age {r.get('age_s', 0):>9.0f} s  "
              f"mesh dp{mesh.get('dp')} pp{mesh.get('pp')} tp{mesh.get('tp')}  attempt {r.get('attempt')}  "
              f"{r['verification']}")
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
            repair_after_s=opts.repair_after_s, standby=opts.standby,
            oidc=dict(issuer=opts.oidc_issuer, audience=opts.oidc_audience, jwks=opts.oidc_jwks,
                      team_claim=opts.oidc_team_claim, role_claim=opts.oidc_role_claim) if opts.oidc_issuer else None))
    except AuthConfigError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(str(e)) from None


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

    from controller.sim.run import parse_sweep, run_view, simulate, sweep
    from controller.spec import parse_spec

    try:
        raw = _yaml.safe_load(Path(opts.spec).read_text())
    except (OSError, _yaml.YAMLError) as e:
        raise CliError(f"cannot read {opts.spec}: {e}") from None
    raw = _with_provider_numbers(raw)
    started = time.perf_counter()
    if opts.sweep:
        rows = sweep(raw, [parse_sweep(s) for s in opts.sweep], days=opts.days, seed=opts.seed, fill_dp=opts.fill)
    elif opts.fill:
        raise CliError("--fill goes with --sweep cluster.simulated.nodes=N1,N2,...")
    else:
        rows = [simulate(parse_spec(raw), days=opts.days, seed=opts.seed)]
    wall = time.perf_counter() - started
    if opts.out:
        from controller.cli import report

        if opts.sweep:
            report.plot_sweep(rows, Path(opts.out))
        else:
            view = run_view(rows[0])
            report.plot(report.build(view, view["events"], view["history"]), Path(opts.out))
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    if opts.json:
        emit_json(public if opts.sweep else public[0])
        return 0
    if not opts.sweep:
        print_simulation(public[0])
    else:
        keys = list(public[0]["setting"])
        gpus = ["GPUs"] if opts.fill else []  # what each cluster came to
        table(keys + gpus + ["ETTR", "steps", "interruptions", "MTTR s", "ckpt every", "largest badput"],
               [[str(r["setting"][k]) for k in keys] + [str(r.get("gpus", "-")) for _ in gpus] + sweep_cells(r)
                for r in public])
        for r in public:
            if r["state"] == "infeasible":
                print(f"{', '.join(f'{k}={v}' for k, v in r['setting'].items())}: infeasible: {r['error']}")
    drawn = f"; {'sweep' if opts.sweep else 'timeline'}: {opts.out}" if opts.out else ""
    print(f"\n{len(rows)} simulation(s) in {wall:.1f} s{drawn}")
    return 0


def cmd_dashboards_push(opts: argparse.Namespace) -> int:
    from controller.cli.dashboards import DEFAULT_DIR, PushError, push

    if not opts.token:
        raise CliError("give --token (or GRAFANA_TOKEN): a Grafana service-account token with the Editor role")
    try:
        pushed = push(opts.url.rstrip("/"), opts.token, Path(opts.dir) if opts.dir else DEFAULT_DIR)
    except PushError as e:
        raise CliError(str(e)) from None
    if opts.json:
        emit_json(pushed)
    else:
        for board in pushed:
            print(f"{board['title']}: version {board['version']} at {opts.url.rstrip('/')}{board['url'] or ''}")
    return 0
