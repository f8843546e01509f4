"""`goodput` command line. Thin: parse, call a service, print. Imports no Ray or torch at import time
so `goodput --help` is instant; every command takes --json and fails with one clear line."""

from __future__ import annotations

import argparse
import faulthandler
import io
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from controller.cli.accounts import add_commands as add_account_commands
from controller.cli.client import DEFAULT_HOST, DEFAULT_PORT
from controller.cli.local import (DEFAULT_API, checkpoints_from_store, cmd_dashboards_push, cmd_k8s_node_labels,
                                  cmd_plan, cmd_run, cmd_serve, cmd_simulate)
from controller.cli.remote import (checkpoints_from_service, cmd_cancel, cmd_drill, cmd_events, cmd_list, cmd_nodes,
                                   cmd_report, cmd_resume, cmd_status, cmd_submit)
from controller.cli.render import CliError
from controller.drills import DrillKind
from controller.errors import ClusterError, RegistryBusy
from controller.spec import SpecError
from trainer.protocol import PROTOCOL_POINTS


def cmd_checkpoints(opts: argparse.Namespace) -> int:
    """The service's index of a run's checkpoints, or with --uri the store's own, verified file by file."""
    return checkpoints_from_store(opts) if opts.uri else checkpoints_from_service(opts)


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
    drill.add_argument("--target", help="node name (kill-node, the silent faults), rank number, or replica:K (a data-parallel "
                       "replica: its last rank, or that rank's node); default: the last rank")
    drill.add_argument("--at-step", type=int, help="inject once this step is done; default: now")
    drill.add_argument("--factor", type=float, help="slow-rank: how many times slower (default 1.5)")
    drill.add_argument("--seconds", type=float, help="storage-outage: how long writes are refused (default 30); "
                       "partition, freeze-node: how long until it heals (default: never); collective-fault: how late "
                       "the collective starts (default: it fails)")
    drill.add_argument("--delay-ms", type=float, help="slow-link: milliseconds added to what the node sends (default 50)")
    drill.add_argument("--loss", type=float, help="lossy-link: percent of the node's packets dropped (default 5)")
    drill.add_argument("--point", choices=PROTOCOL_POINTS, help="collective-fault: the replica protocol's collective "
                       "that fails: the epoch's group init, the gradient reduce, the replica's vote, the agreement "
                       "across replicas, or an epoch switch's state transfer (default reduce)")
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
    serve.add_argument("--standby", action="store_true",
                       help="if another goodput serve leads this registry, wait as its standby (answering /healthz, "
                            "not ready) and take over when it is gone, instead of refusing")
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
    serve.add_argument("--oidc-issuer", default=os.environ.get("GOODPUT_OIDC_ISSUER"),
                       help="accept an identity provider's JWTs from this issuer as well as goodput tokens "
                            "(default $GOODPUT_OIDC_ISSUER)")
    serve.add_argument("--oidc-audience", default=os.environ.get("GOODPUT_OIDC_AUDIENCE", "goodput"),
                       help="the audience its tokens must name (default $GOODPUT_OIDC_AUDIENCE or goodput)")
    serve.add_argument("--oidc-jwks", default=os.environ.get("GOODPUT_OIDC_JWKS"),
                       help="its signing keys: a JWKS URL or file (default: from the issuer's discovery document)")
    serve.add_argument("--oidc-team-claim", default="goodput_team", help="the claim that names the team")
    serve.add_argument("--oidc-role-claim", default="goodput_role",
                       help="the claim that names the role (viewer when absent)")
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
    nodes = sub.add_parser("nodes", help="the service's nodes and their states; drain one before it goes; release "
                                         "a quarantined or drained one")
    nodes.add_argument("action", nargs="?", choices=["list", "drain", "release"], default="list")
    nodes.add_argument("node", nargs="?", help="with drain or release: the node")
    nodes.add_argument("--by", metavar="DEADLINE", help="with drain: when the node goes (90s, 30m, 2h, or an ISO time)")
    nodes.add_argument("--json", action="store_true")
    nodes.set_defaults(func=cmd_nodes)
    add_account_commands(sub)
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
    simulate.add_argument("--fill", action="store_true",
                          help="with --sweep cluster.simulated.nodes=...: dp grows to fill each cluster (tp, pp, "
                               "samples per replica and min_dp's share kept), so the sweep is the world growing")
    simulate.add_argument("--out", metavar="PNG", help="draw the run's timeline, or with --sweep its settings "
                                                     "(a curve along a numeric axis: ETTR and MTTR)")
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
    tok = sub.add_parser("tokenize", help="tokenize .txt/.jsonl/.parquet files into uint32 shards for "
                                          "data.kind shards (to file:// or s3://)")
    tok.add_argument("files", nargs="+", type=Path)
    tok.add_argument("--tokenizer", required=True, type=Path, help="a local tokenizer.json (Hugging Face tokenizers)")
    tok.add_argument("--out", required=True, help="where the dataset goes: file://PATH or s3://BUCKET/PREFIX")
    tok.add_argument("--field", default="text", help="the text field of .jsonl rows and .parquet columns (text)")
    tok.add_argument("--eos", help="the end-of-sequence token appended to every document (default: the first of "
                                   "<|end_of_text|>, <|endoftext|>, </s>, <eos>, [SEP] the tokenizer has)")
    tok.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard, about (268,435,456)")
    tok.add_argument("--json", action="store_true", help="print the manifest as JSON at the end")
    tok.set_defaults(func=cmd_tokenize)
    export = sub.add_parser("export", help="a run's checkpoint as a Hugging Face Llama folder (safetensors + "
                                           "config.json) that transformers loads")
    export.add_argument("spec", metavar="RUN", help="a run of the service (GOODPUT_URL; its checkpoints are read "
                        "directly from their store), or a run's spec file (its name and checkpoint.uri)")
    export.add_argument("--hf", required=True, type=Path, help="the folder to write")
    export.add_argument("--step", type=int, help="the step to export (default: the newest that verifies)")
    export.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    export.set_defaults(func=cmd_export)
    ev = sub.add_parser("eval", help="mean next-token loss of a run's checkpoint on a text file")
    ev.add_argument("spec", metavar="RUN", help="a run of the service (GOODPUT_URL), or a run's spec file")
    ev.add_argument("--text", required=True, type=Path, help="a UTF-8 text file, tokenized whole")
    ev.add_argument("--step", type=int, help="the step (default: the newest that verifies)")
    ev.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one the run's data.uri was "
                                                   "tokenized with, as its manifest records)")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)
    return parser


def _with_model_numbers(spec: Any) -> Any:
    """A provider model's numbers (the checkpoint's reader builds the model): CliError if it cannot be had."""
    from controller.providers import with_model_numbers
    from controller.spec import SpecError

    try:
        return with_model_numbers(spec)
    except SpecError as e:
        raise CliError(str(e)) from None


def _checkpointed_run(ref: str) -> tuple[Any, str, Any]:
    """(spec, run id, checkpoint store) of `ref`: a spec file, or a run of the service, whose spec and
    checkpoint store the API gives; the checkpoints themselves are read from the store, as `goodput
    checkpoints --uri` reads them."""
    from checkpointing.store import StoreError, open_store
    from controller.cli.remote import api
    from controller.spec import SpecError, checkpoint_store, load_spec, parse_spec

    path = Path(ref)
    if path.is_file() or path.suffix in (".yaml", ".yml", ".json") or os.sep in ref:
        spec = _with_model_numbers(load_spec(path))
        return spec, spec.name, checkpoint_store(spec, probe=False)
    with api() as client:
        run = client.call("GET", f"/v1/runs/{ref}")
        raw = client.call("GET", f"/v1/runs/{ref}/spec")
    try:
        spec = _with_model_numbers(parse_spec(raw))
        return spec, run["id"], open_store(run["checkpoint_uri"] or spec.checkpoint.uri)
    except (SpecError, StoreError) as e:
        raise CliError(f"run {ref}: {e}") from None


def cmd_eval(opts: argparse.Namespace) -> int:
    import json

    from checkpointing.manifest import CheckpointError
    from checkpointing.store import StoreError
    from trainer.export import load_full_model, mean_loss, text_windows

    spec, run_id, store = _checkpointed_run(opts.spec)
    model = spec.to_model_config()
    tokenizer = opts.tokenizer
    if tokenizer is None:
        sets = spec.data.to_config().datasets
        if not sets:
            raise CliError("the run was not trained on tokenized text (data.kind shards): name --tokenizer")
        from checkpointing.store import open_store
        from trainer.shards import DatasetManifest

        tokenizer = Path(DatasetManifest.read(open_store(sets[0][0])).tokenizer["file"])
    try:
        windows = text_windows(opts.text.read_text(encoding="utf-8"), tokenizer, model.seq_len)
        step, state = load_full_model(store, run_id, model, opts.step)
    except (CheckpointError, StoreError, ValueError, OSError) as e:
        raise CliError(str(e)) from None
    loss = mean_loss(model, state, windows)
    out = {"run": run_id, "step": step, "loss": loss, "windows": len(windows), "tokens": int(windows.numel()),
           "predicted": int(windows[:, 1:].numel())}
    if opts.json:
        print(json.dumps(out))
    else:
        print(f"run {run_id!r} step {step}: mean loss {loss:.4f} nats over {out['predicted']:,} predicted tokens "
              f"({len(windows)} windows of {model.seq_len})")
    return 0


def cmd_export(opts: argparse.Namespace) -> int:
    from checkpointing.manifest import CheckpointError
    from checkpointing.store import StoreError
    from trainer.export import export_hf

    spec, run_id, store = _checkpointed_run(opts.spec)
    try:
        step = export_hf(store, run_id, spec.to_model_config(), opts.hf, step=opts.step, dtype=opts.dtype)
    except (CheckpointError, StoreError, ValueError) as e:
        raise CliError(str(e)) from None
    print(f"{opts.hf}: step {step} of run {run_id!r} as a Hugging Face Llama model ({opts.dtype})")
    return 0


def cmd_tokenize(opts: argparse.Namespace) -> int:
    from trainer.tokenize import TokenizeError, progress_printer, tokenize

    try:
        manifest = tokenize(opts.files, opts.tokenizer, opts.out, field_name=opts.field, eos=opts.eos,
                            shard_tokens=opts.shard_tokens, progress=None if opts.json else progress_printer())
    except TokenizeError as e:
        raise CliError(str(e)) from None
    if opts.json:
        print(manifest.to_json())
    else:
        print(f"\n{opts.out}: {manifest.documents:,} documents, {manifest.tokens:,} tokens in "
              f"{len(manifest.shards)} shard(s); vocabulary {manifest.tokenizer['vocab_size']:,}, "
              f"eos id {manifest.tokenizer['eos_id']}")
    return 0


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to the process's stderr (a stuck controller).

    faulthandler writes to a file descriptor, so it takes the process's own stderr, not whatever
    ``sys.stderr`` is now (an embedding program or a test may have swapped it for an object with none).
    """
    stream = sys.__stderr__
    if not hasattr(signal, "SIGUSR1") or stream is None:
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)
    except (OSError, ValueError, io.UnsupportedOperation):
        return  # no descriptor to write to (stderr closed or detached): nothing to dump to


def main(argv: list[str] | None = None) -> None:
    dump_stacks_on_sigusr1()
    opts = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = opts.func
    try:
        code = func(opts)
    except (SpecError, CliError, ClusterError, RegistryBusy) as e:
        print(f"goodput: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("goodput: cancelled", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
