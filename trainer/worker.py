"""The entry point every launcher calls for one rank: Ray actors, torchrun, or a test's processes.

`run_worker(args, sink)` joins the process group through a rendezvous store that lives outside the
ranks (the controller's, or torchrun's agent store), builds the dp/pp/tp mesh and trains from
`args.start_step`. `python -m trainer.worker --config C.json --report-dir D` is the torchrun form.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from trainer.config import TrainerConfig, config_from_dict
from trainer.parallel import build_mesh, choose_device, init_process_group
from trainer.report import JsonlSink, ReportSink, StepReport


@dataclass(frozen=True, kw_only=True)
class WorkerArgs:
    rank: int
    """Global rank of this process."""
    world_size: int
    """dp * pp * tp of this attempt."""
    store_host: str
    """Host of the rendezvous TCPStore (never a rank that can die)."""
    store_port: int
    """Port of the rendezvous TCPStore."""
    store_prefix: str
    """Key prefix of this attempt, so a new attempt never reads an old one's keys."""
    config: TrainerConfig
    """What to train, on which mesh."""
    attempt: int = 0
    """Attempt number of the run."""
    start_step: int = 0
    """Step to continue from (with `cursor`, from a checkpoint's manifest)."""
    cursor: int = 0
    """Global sample cursor at `start_step`."""
    resume_from: str | None = None
    """Checkpoint directory to load before training; None starts from the seeded init."""
    collective_timeout_s: float = 120.0
    """Process-group timeout: a collective waiting longer than this fails."""
    run_id: str = "run"
    """Run id; names the checkpoint folder."""
    checkpoint_root: str | None = None
    """Local folder holding `{run_id}/step-N/`; None saves nothing."""
    checkpoint_every: int = 0
    """Save every this many steps (and at the last step); 0 saves nothing."""
    checkpoint_keep: int = 3
    """Committed steps to keep."""


@dataclass(frozen=True, kw_only=True)
class WorkerSummary:
    rank: int
    """Who."""
    step: int
    """Steps done when the worker returned."""
    cursor: int
    """Sample cursor when the worker returned."""
    last_loss: float | None
    """Loss of the last step (last-stage ranks)."""


StepHook = Callable[["object", StepReport], None]


def run_worker(args: WorkerArgs, sink: ReportSink, on_step: StepHook | None = None) -> WorkerSummary:
    """Train one rank to `config.train.steps`; `on_step(trainer, report)` runs after every step."""
    from trainer.train import Trainer  # torch-heavy; keep `import trainer.worker` cheap for launchers

    args.config.validate(world_size=args.world_size)
    choice = choose_device(args.config.train.dtype)
    base = dist.TCPStore(args.store_host, args.store_port, is_master=False, wait_for_workers=False)
    store = dist.PrefixStore(args.store_prefix, base)
    init_process_group(rank=args.rank, world_size=args.world_size, store=store, backend=choice.backend,
                       timeout_s=args.collective_timeout_s)
    try:
        mesh = build_mesh(args.config.mesh, choice.device.type)
        trainer = Trainer(args.config, mesh, choice, attempt=args.attempt)
        trainer.step, trainer.cursor = args.start_step, args.cursor
        if args.resume_from is not None:
            from trainer.checkpoint import load

            load(trainer, Path(args.resume_from))
            sink.event("restored", {"step": trainer.step, "path": args.resume_from})
        last: StepReport | None = None
        while trainer.step < args.config.train.steps:
            last = trainer.train_step()
            sink.report(last)
            if on_step is not None:
                on_step(trainer, last)
            if _checkpoint_due(args, trainer.step):
                _save(args, trainer, sink)
        return WorkerSummary(rank=args.rank, step=trainer.step, cursor=trainer.cursor,
                             last_loss=last.loss if last else None)
    finally:
        dist.destroy_process_group()


def _checkpoint_due(args: WorkerArgs, step: int) -> bool:
    if args.checkpoint_root is None or args.checkpoint_every <= 0:
        return False
    return step % args.checkpoint_every == 0 or step == args.config.train.steps


def _save(args: WorkerArgs, trainer: "object", sink: ReportSink) -> None:
    from checkpointing.manifest import apply_retention, step_dir
    from trainer.checkpoint import save

    assert args.checkpoint_root is not None
    directory = step_dir(args.checkpoint_root, args.run_id, trainer.step)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    manifest = save(trainer, directory, run_id=args.run_id)
    if manifest is not None:
        removed = apply_retention(args.checkpoint_root, args.run_id, args.checkpoint_keep)
        sink.event("checkpoint_committed", {"step": manifest.step, "path": str(directory),
                                            "seconds": time.perf_counter() - t0, "removed": removed})


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
