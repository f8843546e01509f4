"""Recovery mechanism, measured both ways on the same mesh and checkpoint: rebuild the process group
inside surviving processes (destroy, re-init under a fresh store prefix, rebuild the model, load)
versus start fresh processes (spawn, import torch, init, build, load). dp2 x pp2 x tp2, 8 ranks.

This measures the mechanisms alone. What goodput does with it (controller/ray/worker_group.py): the
rebuild's speed without its catch (a gloo survivor blocked in a collective cannot be freed in
place), by forking each attempt's training process from an actor that imported torch once; the
end-to-end comparison is in benchmarks/recovery_drills.py.

Both are measured --repeat times (at least 5), interleaved (ABAB..., the order alternating by round),
each from a cold page cache: before every trial the checkpoint's files and torch's own (its shared
libraries and modules, what a fresh process reads to import it) are dropped from the page cache with
posix_fadvise(DONTNEED), as on a replacement node that never ran this job. Prints n, median, min and
max of each, and the ratio of the medians.

    python benchmarks/regroup_vs_restart.py [--repeat 5]

Its record: benchmarks/records/regroup_vs_restart.json.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
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
    from trainer.restore import load

    store = open_store(uri)
    load(trainer, store, read_manifest(store, "bench", 2))


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


def evict(*roots: Path) -> int:
    """Drop every regular file under the roots from the page cache (no root needed: DONTNEED drops the
    clean pages of files we can open); bytes advised."""
    dropped = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    dropped += os.fstat(fd).st_size
                finally:
                    os.close(fd)
    return dropped


def main() -> None:
    import argparse
    import statistics

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    repeat = max(5, opts.repeat)
    torch_dir = Path(torch.__file__).parent
    regroup: list[float] = []
    fresh: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        uri = f"file://{root}"
        for i in range(repeat):
            for kind in (("regroup", "restart") if i % 2 == 0 else ("restart", "regroup")):
                if kind == "restart" and not regroup:
                    continue  # the first round's regroup writes the checkpoint both load
                evict(Path(root), torch_dir)
                if kind == "regroup":  # (a committed step is never written again: later rounds load it)
                    regroup.append(max(run_ranks(save_then_regroup, 8, timeout_s=600, uri=uri)))
                else:
                    spawned = time.time()
                    fresh.append(max(run_ranks(restart, 8, timeout_s=600, start="spawn", uri=uri, spawned_at=spawned)))
        if len(fresh) < repeat:
            evict(Path(root), torch_dir)
            spawned = time.time()
            fresh.append(max(run_ranks(restart, 8, timeout_s=600, start="spawn", uri=uri, spawned_at=spawned)))

    def line(values: list[float]) -> str:
        return (f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, "
                f"n={len(values)})")

    print("cold page cache (checkpoint and torch's files dropped before each trial), interleaved")
    print(f"rebuild in surviving processes (destroy + re-init PG + rebuild model + load): {line(regroup)}")
    print(f"fresh processes (spawn + import torch + init PG + build model + load):        {line(fresh)}")
    ratio = statistics.median(regroup) / statistics.median(fresh)
    print(f"ratio rebuild / restart (medians) = {ratio:.3f}")
    figures = [records.figure("cold cache: rebuild in surviving processes", regroup, "s"),
               records.figure("cold cache: fresh processes", fresh, "s"),
               records.figure("cold cache: rebuild / fresh processes (medians)", [ratio], "ratio")]
    records.write("regroup_vs_restart", figures, code=["trainer/parallel.py", "trainer/train.py", "trainer/restore.py"])


if __name__ == "__main__":
    main()
