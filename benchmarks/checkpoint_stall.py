"""Training-loop stall of an async checkpoint save / time of a synchronous save of the same state.

A ~54M-parameter model with its Adam state (~650 MB fp32), one rank, local file store. Both modes
save the same trainer alternately; the async figure is the time `save()` blocks the loop (staging),
the sync figure the whole save including checksums and the commit. Target: <= 0.1.

    python benchmarks/checkpoint_stall.py [--repeat 3]

Its record: benchmarks/records/checkpoint_stall.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch.distributed as dist  # noqa: E402

from benchmarks import records  # noqa: E402
from checkpointing.store import LocalStore  # noqa: E402
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig  # noqa: E402

MODEL = ModelConfig(n_layers=12, d_model=512, n_heads=8, vocab_size=16_000, seq_len=64)


def main() -> None:
    from trainer.checkpoint import Checkpointer
    from trainer.parallel import build_mesh, choose_device
    from trainer.report import ListSink
    from trainer.train import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    cfg = TrainerConfig(model=MODEL, data=DataConfig(seed=0),
                        train=TrainConfig(steps=10**6, global_batch=2, micro_batch=2, dtype="float32"),
                        mesh=MeshShape())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
    trainer.train_step()  # Adam state exists from here
    print(f"model: {MODEL.num_params() / 1e6:.1f}M params", flush=True)
    with tempfile.TemporaryDirectory(dir=os.environ.get("GOODPUT_BENCH_DIR")) as tmp:
        store = LocalStore(Path(tmp))
        sink = ListSink()
        sync = Checkpointer(store, run_id="sync", attempt=0, keep=1, sink=sink, staging_dir=Path(tmp) / "s",
                            use_async=False)
        asyn = Checkpointer(store, run_id="async", attempt=0, keep=1, sink=sink, staging_dir=Path(tmp) / "s",
                            use_async=True)
        sync_s, stall_s, async_total_s = [], [], []
        for _ in range(opts.repeat):
            trainer.step += 1
            sync_s.append(sync.save(trainer).blocked_s)
            trainer.step += 1
            t0 = time.perf_counter()
            stall_s.append(asyn.save(trainer).blocked_s)
            asyn.wait()
            async_total_s.append(time.perf_counter() - t0)
        sync.close()
        asyn.close()
    failed = [d for k, d in sink.events if k == "checkpoint_failed"]
    assert not failed, failed
    s, a = statistics.median(sync_s), statistics.median(stall_s)
    print(f"synchronous save: median {s:.2f} s (min {min(sync_s):.2f}, max {max(sync_s):.2f})")
    print(f"async save stall: median {a:.3f} s (min {min(stall_s):.3f}, max {max(stall_s):.3f}); "
          f"background completion median {statistics.median(async_total_s):.2f} s")
    print(f"ratio stall / sync = {a / s:.3f} (target <= 0.1)")
    dist.destroy_process_group()
    figures = [records.figure("stall: async save stall", stall_s, "s"),
               records.figure("stall: synchronous save", sync_s, "s"),
               records.figure("stall: async save stall / synchronous save (medians)", [a / s], "ratio", goal="<= 0.1"),
               records.figure("stall: async save, background completion", async_total_s, "s")]
    records.write("checkpoint_stall", figures, code=["trainer/checkpoint.py", "checkpointing/manifest.py",
                                                     "checkpointing/store/local.py"],
                  extra={"params": MODEL.num_params()})


if __name__ == "__main__":
    main()
