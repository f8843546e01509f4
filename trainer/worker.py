"""The entry point every launcher calls for one rank: Ray actors, torchrun, or a test's processes.

`run_worker(args, sink)` joins the process group through a rendezvous store that lives outside the
ranks (the controller's, or torchrun's agent store), builds the dp/pp/tp mesh and trains from
`args.start_step`. `python -m trainer.worker --config C.json --report-dir D` is the torchrun form.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from checkpointing.manifest import CheckpointError
from checkpointing.peer import PeerPoint
from checkpointing.schedule import CheckpointInterval
from checkpointing.store import OutageGate, open_store
from trainer.args import WorkerArgs, WorkerSummary
from trainer.config import MeshShape, TrainerConfig, config_from_dict, state_fingerprint
from trainer.parallel import build_mesh, choose_device, init_process_group, use_interface
from trainer.report import JsonlSink, ReportSink, StepReport
from trainer.stop import Keep, StopWatch
from trainer.switches import DrillSwitches


StepHook = Callable[["object", StepReport], None]


def run_worker(args: WorkerArgs, sink: ReportSink, on_step: StepHook | None = None,
               switches: DrillSwitches | None = None, on_leave: Callable[[], None] | None = None,
               on_snapshot_phase: Callable[[str, int], None] | None = None) -> WorkerSummary:
    """Train one rank to `config.train.steps`; `on_step(trainer, report)` runs after every step.
    `switches`: what drills ask of this GPU slot (slow it, flip a bit, refuse checkpoint writes).
    `on_leave()` runs when the attempt fails here, before its teardown (process group, snapshots,
    saves in flight). `on_snapshot_phase(phase, step)`: fault injection inside a peer snapshot's
    exchange (trainer.peer.PHASES)."""
    from trainer.checkpoint import Checkpointer
    from trainer.peer import PeerSnapshots
    from trainer.train import Trainer  # torch-heavy; keep `import trainer.worker` cheap for launchers

    args.config.validate(world_size=args.world_size)
    use_interface(args.interface)
    choice = choose_device(args.config.train.dtype)
    base = dist.TCPStore(args.store_host, args.store_port, is_master=False, wait_for_workers=False)
    store = dist.PrefixStore(args.store_prefix, base)
    config, cross, replica = args.config, None, None
    if args.replica_domain:
        from trainer.replica import CrossReplica

        config, r = replica_config(args.config), args.world_size // args.config.mesh.dp_replicas
        replica, local = divmod(args.rank, r)
        init_process_group(rank=local, world_size=r, backend=choice.backend, timeout_s=args.collective_timeout_s,
                           store=dist.PrefixStore(f"{args.store_prefix}replica-{replica}/i{args.incarnation}/", base))
        cross = CrossReplica(store, replica=replica, position=local, device=choice.device,
                             timeout_s=args.collective_timeout_s, replicas=args.config.mesh.dp_replicas,
                             keep_batch=args.batch_while_healing == "keep")
    else:
        init_process_group(rank=args.rank, world_size=args.world_size, store=store, backend=choice.backend,
                           timeout_s=args.collective_timeout_s)
    checkpointer = None
    peers = None
    stop: StopWatch | None = None
    replica_log: list[dict[str, Any]] = []
    try:
        mesh = build_mesh(config.mesh, choice.device.type)
        trainer = Trainer(config, mesh, choice, attempt=args.attempt, sink=sink, switches=switches, replicas=cross)
        trainer.rank = args.rank  # reports name the run's rank
        trainer.step, trainer.cursor = args.start_step, args.cursor
        ckpt_store = open_store(args.checkpoint_uri) if args.checkpoint_uri else None
        if ckpt_store is not None and switches is not None:
            ckpt_store = OutageGate(ckpt_store, lambda: switches.outage_until)
        folder = Path(args.peer_dir) / (args.peer_key or args.run_id) if args.peer_dir else None
        layout: Any = None
        if args.peer_restore is not None:
            if folder is None:
                raise ValueError("peer_restore needs peer_dir: where this node keeps its snapshots")
            layout = _restore_from_peers(trainer, folder, args.peer_restore, sink, choice.device, args.in_place)
        elif ckpt_store is not None and args.resume_step is not None:
            _restore_from_store(trainer, ckpt_store, args, sink, choice.device)
        elif args.config.train.init_hf and trainer.step == 0:  # a fresh start from Hugging Face weights
            from trainer.hf import load_into

            t0 = time.perf_counter()
            count = load_into(trainer, Path(args.config.train.init_hf))
            if args.rank == 0:
                sink.event("initialised", {"from": args.config.train.init_hf, "tensors": count,
                                           "seconds": time.perf_counter() - t0})
        if cross is not None:
            _join_replicas(trainer, cross, args, sink, replica_log)
        if args.peer_every > 0 and folder is not None:
            peers = PeerSnapshots(folder=folder, run_id=args.run_id, attempt=args.attempt,
                                  buddy=_buddy_in_world(args), sink=sink,
                                  identity=state_fingerprint(args.config.model), mesh=config.mesh.axes(),
                                  keep=((args.peer_restore.attempt, args.peer_restore.step)
                                        if args.peer_restore else None),
                                  on_phase=on_snapshot_phase)
            peers.adopt_layout(layout)
        if trainer.probes is not None:
            trainer.probes.last_clean_step = trainer.step
        if ckpt_store is not None and (args.checkpoint_every > 0 or args.checkpoint_auto):
            checkpointer = Checkpointer(ckpt_store, run_id=args.run_id, attempt=args.attempt,
                                        keep=args.checkpoint_keep, sink=sink, use_async=args.checkpoint_async,
                                        staging_dir=Path(args.staging_dir),
                                        retry_budget_s=args.store_retry_budget_s)
        interval = CheckpointInterval(args.checkpoint_every, auto=args.checkpoint_auto, mtbf_s=args.mtbf_s)
        if args.stoppable and cross is None:
            stop = StopWatch(store, rank=args.rank, device=choice.device)
        stopped: Keep | None = None
        said_terminating = False
        last: StepReport | None = None
        since_snapshot: list[StepReport] = []
        """This rank's reports since its last snapshot: the next one's markers carry them."""
        while trainer.step < args.config.train.steps:
            if cross is not None:
                last = _replica_step(trainer, args, sink, replica_log)
                del replica_log[:-16]  # (what the next step reads back; a long run's log would grow without end)
            else:
                last = trainer.train_step()
            if peers is not None and trainer.step % args.peer_every == 0:
                since_snapshot.append(last)
                last = dataclasses.replace(last, snapshot_s=peers.take(trainer, since_snapshot))
                since_snapshot = []
            elif peers is not None:
                since_snapshot.append(last)
            if peers is not None:  # heard of once its snapshot is on the buddies (PeerSnapshots.deliver)
                peers.deliver(functools.partial(sink.report, last))
            else:
                sink.report(last)
            if on_step is not None:
                on_step(trainer, last)
            saver = cross is None or cross.index == 0  # one replica saves the state all of them hold
            if checkpointer is not None and saver and interval.due(trainer.step, args.config.train.steps):
                timing = checkpointer.save(trainer)
                if timing.skipped is None:
                    if args.rank == 0:
                        sink.event("checkpoint_staged", {"step": timing.step, "blocked_s": timing.blocked_s})
                    chosen = interval.measured(timing.blocked_s, last.step_time_s)
                    if chosen is not None:
                        sink.event("checkpoint_interval", chosen)
            if stop is not None and trainer.step < args.config.train.steps and stop.poll(trainer.step) is not Keep.NONE:
                if stop.terminated_at is not None and not said_terminating:
                    sink.event("terminating", {"step": trainer.step, "signal": "SIGTERM",
                                               "seconds_ago": time.monotonic() - stop.terminated_at})
                    said_terminating = True
                stopped = stop.where(step=trainer.step, peer_every=args.peer_every, has_peers=peers is not None,
                                     has_store=ckpt_store is not None)
                if stopped is not Keep.NONE:
                    checkpointer = _keep_for_stop(trainer, stopped, checkpointer, ckpt_store, args, sink)
                    if args.rank == 0:
                        sink.event("stopped_at_boundary", {"step": trainer.step, "kept": stopped.name.lower(),
                                                           "reason": stop.reason, "agreed_step": stop.agreed_step})
                    break
        if cross is not None:
            _skipped(trainer, cross, sink, None)
            _compare_replicas(trainer, cross, sink)
        return WorkerSummary(rank=args.rank, step=trainer.step, cursor=trainer.cursor,
                             last_loss=last.loss if last else None,
                             stopped=stopped.name.lower() if stopped not in (None, Keep.NONE) else None)
    except BaseException:
        if on_leave is not None:
            on_leave()
        raise
    finally:
        if stop is not None:
            stop.close()
        if checkpointer is not None:
            checkpointer.close()
        if peers is not None:
            peers.close()
        dist.destroy_process_group()


def _keep_for_stop(trainer: Any, keep: Keep, checkpointer: Any, ckpt_store: Any, args: WorkerArgs,
                   sink: ReportSink) -> Any:
    """The stopped step kept as asked: in the store (committed before the rank leaves; a save the
    interval already made of it counts), or in the peer snapshot just taken. The checkpointer (made
    here when the run saves no periodic checkpoints)."""
    from trainer.checkpoint import Checkpointer

    if keep is not Keep.STORE:
        return checkpointer
    if checkpointer is None:
        checkpointer = Checkpointer(ckpt_store, run_id=args.run_id, attempt=args.attempt, keep=args.checkpoint_keep,
                                    sink=sink, use_async=False, staging_dir=Path(args.staging_dir),
                                    retry_budget_s=args.store_retry_budget_s)
    checkpointer.save(trainer)  # (refused, and so not written twice, when the interval's save has it)
    checkpointer.wait()
    return checkpointer


def _buddy_in_world(args: WorkerArgs) -> list[int] | None:
    """This rank's world's buddy permutation: the attempt's, or under failure_domain replica its
    replica's (a replica's snapshots travel on its own world, named by local rank, laid out on its
    own mesh: any replica's copies at a step are the state every replica holds then)."""
    if not args.peer_buddy:
        return None
    if not args.replica_domain:
        return list(args.peer_buddy)
    per = args.world_size // args.config.mesh.dp_replicas
    start = args.rank // per * per
    return list(args.peer_buddy[start:start + per])


def replica_config(config: TrainerConfig) -> TrainerConfig:
    """What one data-parallel replica trains: the run's config with its own mesh (dp_shard x pp x tp)."""
    m = config.mesh
    return dataclasses.replace(config, mesh=MeshShape(dp=m.dp // m.dp_replicas, pp=m.pp, tp=m.tp))


def _join_replicas(trainer: Any, cross: Any, args: WorkerArgs, sink: ReportSink, log: list[dict[str, Any]]) -> None:
    """Take this replica's first membership: epoch 0 at the launch; a replica formed again waits for
    the epoch that lists it as joining, receives a live replica's state there and says so."""
    from trainer.replica import switch_to

    wait_s = max(args.collective_timeout_s, 60.0)
    failed = functools.partial(_discarded, sink)  # (the controller answers a failed forming as a discard)
    if args.incarnation == 0:
        first = cross.board.get(0)
        switch_to(trainer, first, wait_s=wait_s, log=log, on_failed=failed)
        if cross.replica in first.joining:  # its nodes held no copy of the peer step the others loaded
            done = log[-1]
            sink.event("restored", {"source": "replica", "replica": done["source"], "step": trainer.step,
                                    "cursor": trainer.cursor, "bytes_read": 0, "seconds": done["seconds"]})
        return
    first = args.rank % (args.world_size // args.config.mesh.dp_replicas) == 0
    if first:
        sink.event("replica_ready", {"replica": cross.replica, "incarnation": args.incarnation})
    cross.store.set(f"ready/{cross.replica}/{args.incarnation}/{dist.get_rank()}", "1")
    membership = cross.board.wait_joining(cross.replica, wait_s)
    switch_to(trainer, membership, wait_s=wait_s, log=log, on_failed=failed)
    done = log[-1]
    if first:
        plan = cross.last_plan
        sink.event("replica_rejoined", {"replicas": [cross.replica], "epoch": done["epoch"], "step": trainer.step,
                                        "source": done["source"], "at": done["time"], "seconds": done["seconds"],
                                        **({"vouched_by": plan.vouched_by} if plan is not None and plan.vouched_by else {})})


def _compare_replicas(trainer: Any, cross: Any, sink: ReportSink) -> None:
    """Every live replica's state checksum at this rank's position; the first replica says whether
    they agree (they hold the same bytes after any failure and rejoin)."""
    from trainer.tensors import bits_checksum
    from trainer.replica import state_tensors

    sums = cross.compare(bits_checksum(state_tensors(trainer.parts, trainer.optimizers)))
    if cross.index == 0:  # (the controller reads a disagreement as an SDC: controller/attribution.checksums_suspect)
        per = dist.get_world_size()
        sink.event("replica_checksums", {"position": cross.position, "step": trainer.step,
                                         "replicas": list(cross.membership.replicas), "checksums": sums,
                                         "ranks": [k * per + cross.position for k in cross.membership.replicas],
                                         "agreed_step": cross.agreed_step, "agree": len(set(sums)) == 1})


def _replica_step(trainer: Any, args: WorkerArgs, sink: ReportSink, log: list[dict[str, Any]]) -> StepReport:
    """One step committed by every live replica (trainer.replica.replica_step); a discarded step is
    told to the controller at once (from the data plane: the survivors' collective failed). Under
    batch_while_healing shrink, the steps that skipped the out replicas' samples are recorded."""
    from trainer.replica import replica_step

    r = trainer.replicas
    report = replica_step(trainer, wait_s=max(args.collective_timeout_s, 60.0), log=log,
                          on_discarded=functools.partial(_discarded, sink))
    if not r.keep_batch:
        done = next(e for e in reversed(log) if e["kind"] == "step")
        missing = tuple(sorted(set(range(r.replicas)) - set(r.board.get(done["epoch"]).replicas)))
        _skipped(trainer, r, sink, (done["step"], missing) if missing else None)
    return report


def _discarded(sink: ReportSink, detail: dict[str, Any]) -> None:
    """A discarded step or a failed epoch switch, told to the controller by the replica's rank 0."""
    if dist.get_rank() == 0:
        sink.event("replica_step_discarded", {k: v for k, v in detail.items() if k != "kind"})


_skipping: dict[str, Any] = {}
"""batch_while_healing shrink: the span of steps whose out replicas' samples were skipped, so far."""


def _skipped(trainer: Any, cross: Any, sink: ReportSink, step: tuple[int, tuple[int, ...]] | None) -> None:
    """Add a step that skipped the out replicas' samples to the span; with none, the span ends and the
    first replica's rank 0 says what was skipped."""
    if step is not None:
        at, replicas = step
        span = _skipping.setdefault("span", {"from_step": at, "to_step": at, "replicas": set(), "samples": 0})
        span["to_step"] = at
        span["replicas"] |= set(replicas)
        span["samples"] += trainer.config.train.global_batch * len(replicas) // cross.replicas
        return
    span = _skipping.pop("span", None)
    if span is not None and dist.get_rank() == 0 and cross.index == 0:
        sink.event("samples_skipped", {**span, "replicas": sorted(span["replicas"])})


def _restore_from_store(trainer: "object", ckpt_store: "object", args: WorkerArgs, sink: ReportSink,
                        device: "torch.device") -> None:
    """Collective: load `args.resume_step` from the object store; every rank reports `restored`."""
    from trainer.restore import load, shared_manifest

    t0 = time.perf_counter()
    manifest = shared_manifest(ckpt_store, args.run_id, args.resume_step)  # type: ignore[arg-type]
    try:
        read = load(trainer, ckpt_store, manifest)  # type: ignore[arg-type]
    except CheckpointError as e:  # every rank gets it; rank 0 tells the controller, which rejects the step
        if args.rank == 0:
            sink.event("restore_failed", {"source": "store", "step": manifest.step, "error": str(e)})
        raise
    trainer.step, trainer.cursor = manifest.step, manifest.cursor  # type: ignore[attr-defined]
    total = torch.tensor([read], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    sink.event("restored", {"source": "store", "step": manifest.step, "cursor": manifest.cursor,
                            "saved_on_mesh": manifest.mesh, "bytes_read": int(total.item()),
                            "bytes": manifest.total_bytes(), "seconds": time.perf_counter() - t0,
                            "in_place": args.in_place})


def _restore_from_peers(trainer: "object", folder: Path, point: PeerPoint, sink: ReportSink,
                        device: "torch.device", in_place: bool = False) -> Any:
    """Collective: load a peer snapshot step from the host memory of this attempt's nodes (no object
    store read); every rank reports `restored` with the bytes that crossed the process group."""
    from trainer.peer_load import load_from_peers

    t0 = time.perf_counter()
    try:
        loaded = load_from_peers(trainer, folder, point)
    except CheckpointError as e:  # every rank gets it; rank 0 tells the controller, which never picks it again
        if dist.get_rank() == 0:
            sink.event("restore_failed", {"source": "peer", "saved_by_attempt": point.attempt, "step": point.step,
                                          "error": str(e)})
        raise
    trainer.step, trainer.cursor = point.step, point.cursor  # type: ignore[attr-defined]
    totals = torch.tensor([loaded.bytes_received, loaded.bytes_local], dtype=torch.int64, device=device)
    dist.all_reduce(totals)
    sink.event("restored", {"source": "peer", "step": point.step, "cursor": point.cursor,
                            "saved_on_mesh": point.mesh, "saved_by_attempt": point.attempt, "bytes_read": 0,
                            "bytes_from_peers": int(totals[0].item()), "bytes_local": int(totals[1].item()), "how": loaded.how,
                            "seconds": time.perf_counter() - t0, "in_place": in_place})
    return loaded.layout


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: rank, world size and the agent's store come from torchrun's environment."""
    parser = argparse.ArgumentParser(prog="python -m trainer.worker")
    parser.add_argument("--config", required=True, help="JSON file of a TrainerConfig")
    parser.add_argument("--report-dir", required=True, help="each rank appends JSON lines to rank-N.jsonl")
    opts = parser.parse_args(argv)
    with open(opts.config) as f:
        config = config_from_dict(json.load(f))
    rank = int(os.environ["RANK"])
    sink = JsonlSink(os.path.join(opts.report_dir, f"rank-{rank}.jsonl"))
    try:
        run_worker(
            WorkerArgs(
                rank=rank,
                world_size=int(os.environ["WORLD_SIZE"]),
                store_host=os.environ["MASTER_ADDR"],
                store_port=int(os.environ["MASTER_PORT"]),
                store_prefix="goodput/torchrun",
                config=config,
            ),
            sink,
        )
    finally:
        sink.close()


if __name__ == "__main__":
    main()
