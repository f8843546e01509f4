"""`goodput` command line. Thin: parse, call a service, print. Imports no Ray or torch at import time
so `goodput --help` is instant; every command takes --json and fails with one clear line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from controller.spec import SpecError, load_spec


class CliError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


def _emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def cmd_run(opts: argparse.Namespace) -> int:
    from controller.progress import RunProgress
    from controller.torchrun_launch import run_with_torchrun
    from controller.ui import ProgressView

    spec = load_spec(opts.spec)
    mesh = spec.fixed_mesh()
    if mesh is None:
        raise CliError("parallelism: auto needs the planner; give parallelism: {dp, tp, pp}")
    config = spec.trainer_config(mesh)
    slots = spec.local_gpu_slots()
    if mesh.world_size != slots:
        raise CliError(
            f"dp*pp*tp = {mesh.dp}*{mesh.pp}*{mesh.tp} = {mesh.world_size} but cluster.local offers "
            f"{slots} GPU slots (nodes - spares) * gpus_per_node"
        )
    progress = RunProgress(total_steps=config.train.steps)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodput", description="Fault-tolerant LLM training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run SPEC.yaml in this process on the embedded local cluster")
    run.add_argument("spec")
    run.add_argument("--json", action="store_true", help="print the final run as one JSON document")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> None:
    opts = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = opts.func
    try:
        code = func(opts)
    except (SpecError, CliError) as e:
        print(f"goodput: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("goodput: cancelled", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
