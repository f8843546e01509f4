"""Recovery mechanism, measured both ways on the same mesh and checkpoint: rebuild the process group
inside surviving processes (destroy, re-init under a fresh store prefix, rebuild the model, load)
versus start fresh processes (spawn, import torch, init, build, load). dp2 x pp2 x tp2, 8 ranks.

This measures the mechanisms alone. What goodput does with it (controller/ray_workers.py): the
rebuild's speed without its catch (a gloo survivor blocked in a collective cannot be freed in
place), by forking each attempt's training process from an actor that imported torch once; the
end-to-end comparison is in benchmarks/recovery_drills.py.

    python benchmarks/regroup_vs_restart.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.dist.harness import run_ranks  # noqa: E402
from trainer.config import (  # noqa: E402
    DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_from_dict, config_to_dict,
)

SCRATCH = Path(tempfile.gettempdir()) / "goodput-bench"
CONFIG = TrainerConfig(model=ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
                       data=DataConfig(seed=0),
                       train=TrainConfig(steps=2, global_batch=16, micro_batch=2, dtype="float32"),
                       mesh=MeshShape(dp=2, pp=2, tp=2))


def _join(rank: int, world: int, port: int, prefix: str):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.train import Trainer

    store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False))
    init_process_group(rank=rank, world_size=world, store=store, backend="gloo", timeout_s=120)
    cfg = config_from_dict(config_to_dict(CONFIG))
    return Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))


def _load(trainer, uri: str) -> None:  # type: ignore[no-untyped-def]
    from checkpointing.manifest import read_manifest
    from checkpointing.store import open_store
    from trainer.checkpoint import load

    store = open_store(uri)
    load(trainer, store, read_manifest(store, "bench", 2), cache_dir=SCRATCH)


def save_then_regroup(*, rank: int, world_size: int, store_port: int, uri: str) -> float:
    import torch.distributed as dist

    from checkpointing.store import open_store
    from trainer.checkpoint import Checkpointer
    from trainer.report import ListSink

    trainer = _join(rank, world_size, store_port, "first")
    for _ in range(2):
        trainer.train_step()
    ckpt = Checkpointer(open_store(uri), run_id="bench", attempt=0, keep=1, sink=ListSink(),
                        staging_dir=SCRATCH, use_async=False)
    ckpt.save(trainer)
    ckpt.close()
    dist.barrier()
    t0 = time.perf_counter()
    dist.destroy_process_group()
    trainer = _join(rank, world_size, store_port, "second")
    _load(trainer, uri)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return elapsed


def restart(*, rank: int, world_size: int, store_port: int, uri: str, spawned_at: float) -> float:
    import torch.distributed as dist

    trainer = _join(rank, world_size, store_port, "fresh")
    _load(trainer, uri)
    dist.barrier()
    ready = time.time() - spawned_at
    dist.destroy_process_group()
    return ready


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        uri = f"file://{root}"
        regroup = max(run_ranks(save_then_regroup, 8, timeout_s=600, uri=uri))
        spawned = time.time()
        fresh = max(run_ranks(restart, 8, timeout_s=600, uri=uri, spawned_at=spawned))
    print(f"rebuild in surviving processes (destroy + re-init PG + rebuild model + load): {regroup:.2f} s")
    print(f"fresh processes (spawn + import torch + init PG + build model + load):        {fresh:.2f} s")
    print(f"ratio rebuild / restart = {regroup / fresh:.3f}")


if __name__ == "__main__":
    main()
