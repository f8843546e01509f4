"""Rank-side helpers of the checkpoint fault tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist


def train_through_outage(*, rank: int, world_size: int, store_port: int, config: dict, uri: str) -> list:
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    sink = ListSink()
    summary = run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1",
                                    store_port=store_port, store_prefix="outage", config=config_from_dict(config),
                                    run_id="outage", checkpoint_uri=uri, checkpoint_every=2), sink)
    return [summary.step, sink.events]


def die_mid_save(*, rank: int, world_size: int, store_port: int, config: dict, root: str,
                 uri: str | None = None) -> dict:
    """Commit step 2, then at step 4 rank 1 dies after writing its shard but before its marker (the
    store: `uri`, default the folder `root`; shards on their way to a remote one are staged in `root`)."""
    import trainer.checkpoint as ckpt

    trainer, checkpointer, sink = _committed_step_2(rank, world_size, store_port, config, root, "crash", 3.0, uri)
    for _ in range(2):
        trainer.train_step()
    if rank == 1:
        def killed(*args: Any, **kwargs: Any) -> None:
            os._exit(1)  # SIGKILL-like: no cleanup, no marker

        ckpt.write_rank_marker = killed  # type: ignore[assignment]
    checkpointer.save(trainer)
    checkpointer.wait()
    return {"events": sink.events}


def resave_committed_step(*, rank: int, world_size: int, store_port: int, config: dict, root: str,
                          uri: str | None = None) -> dict:
    """Commit step 2; train on, then come back to step 2 (as an attempt does that skipped a newer step
    as unreadable and trained through it again) and save it again: nothing may be written."""
    trainer, checkpointer, sink = _committed_step_2(rank, world_size, store_port, config, root, "resave", 10.0, uri)
    for _ in range(2):
        trainer.train_step()  # other parameters now
    trainer.step = 2
    timing = checkpointer.save(trainer)
    checkpointer.close()
    return {"events": sink.events, "skipped": timing.skipped}


def _committed_step_2(rank: int, world_size: int, store_port: int, config: dict, root: str, run_id: str,
                      commit_timeout_s: float, uri: str | None) -> tuple[Any, Any, Any]:
    """Join the process group, train two steps and commit step 2: (trainer, checkpointer, sink)."""
    import trainer.checkpoint as ckpt
    from checkpointing.store import open_store
    from trainer.config import config_from_dict
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.report import ListSink
    from trainer.train import Trainer

    cfg = config_from_dict(config)
    store = dist.PrefixStore(run_id, dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=60)
    sink = ListSink()
    trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
    checkpointer = ckpt.Checkpointer(open_store(uri or f"file://{root}"), run_id=run_id, attempt=0, keep=5, sink=sink,
                                     staging_dir=Path(root) / "staging", commit_timeout_s=commit_timeout_s)
    for _ in range(2):
        trainer.train_step()
    checkpointer.save(trainer)
    checkpointer.wait()
    return trainer, checkpointer, sink


def resume_step(*, rank: int, world_size: int, store_port: int, config: dict, uri: str, run_id: str,
                step: int) -> dict:
    """A new attempt of `run_id` that resumes from `step`: its summary, or the error its load raised."""
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    sink = ListSink()
    try:
        summary = run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1",
                                        store_port=store_port, store_prefix="resume", config=config_from_dict(config),
                                        run_id=run_id, attempt=1, checkpoint_uri=uri, resume_step=step), sink)
        return {"events": sink.events, "step": summary.step, "error": None}
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return {"events": sink.events, "step": None, "error": f"{type(e).__name__}: {e}"}
