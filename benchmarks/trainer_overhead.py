"""Trainer step time / a bare hand-written torch loop on the same mesh and model.

Both run in the same processes, steps interleaved (goodput, bare, goodput, bare, ...) so machine
noise hits both alike; the ratio of medians is printed per mesh. Target: <= 1.05. Beside it, the
per-step look for a stop at the step boundary (trainer/stop.py: rank 0 asks the store, one all-reduce
of an int; every run of a service makes it, for preemptions, drains and SIGTERMs), timed after each
goodput step: its median, and (step + look) / step.

    python benchmarks/trainer_overhead.py [--steps 20] [--meshes 2,1,1 2,2,2]

Its record: benchmarks/records/trainer_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import records  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig  # noqa: E402

MODEL = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128)


def bare_loop(mesh: "torch.distributed.device_mesh.DeviceMesh", shape: MeshShape, global_batch: int,
              micro_batch: int, lr: float):
    """What a user would write by hand with torch alone: no goodput code but the model class."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from trainer.model import Transformer

    pp_rank = mesh["pp"].get_local_rank()
    per_stage = MODEL.n_layers // shape.pp
    with torch.device("meta"):
        model = Transformer(MODEL)
    model.keep_only(range(pp_rank * per_stage, (pp_rank + 1) * per_stage),
                    first=pp_rank == 0, last=pp_rank == shape.pp - 1)
    model.to_empty(device="cpu")
    model.init_weights(0)
    if shape.tp > 1:
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()})
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=shape.pp == 1)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=shape.pp == 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    n_micro = global_batch // (shape.dp * micro_batch)
    rows = torch.randint(0, MODEL.vocab_size, (n_micro * micro_batch, MODEL.seq_len + 1))
    x, y = rows[:, :-1], rows[:, 1:]

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), tgt.flatten(0, 1))

    if shape.pp > 1:
        stage = PipelineStage(model, pp_rank, shape.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=loss_fn)

        def step() -> None:
            if pp_rank == 0:
                schedule.step(x)
            elif pp_rank == shape.pp - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        def step() -> None:
            for i, (xi, yi) in enumerate(zip(x.chunk(n_micro), y.chunk(n_micro))):
                model.set_requires_gradient_sync(i == n_micro - 1)  # type: ignore[operator]
                (loss_fn(model(xi), yi) / n_micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def measure(*, rank: int, world_size: int, store_port: int, mesh: tuple[int, int, int], steps: int) -> dict:
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.stop import StopWatch
    from trainer.train import Trainer

    torch.set_num_threads(1)
    dp, pp, tp = mesh
    shape = MeshShape(dp=dp, pp=pp, tp=tp)
    cfg = TrainerConfig(model=MODEL, data=DataConfig(seed=0),
                        train=TrainConfig(steps=10**6, global_batch=16, micro_batch=2, lr=1e-3, dtype="float32"),
                        mesh=shape)
    store = dist.PrefixStore("bench", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=300)
    try:
        device_mesh = build_mesh(shape, "cpu")
        trainer = Trainer(cfg, device_mesh, choose_device("float32"))
        bare = bare_loop(device_mesh, shape, 16, 2, 1e-3)
        stop = StopWatch(store, rank=rank, device=torch.device("cpu"), catch_sigterm=False)
        goodput_times, bare_times, poll_times = [], [], []
        for i in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            t1 = time.perf_counter()
            stop.poll(trainer.step)
            t1p = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            bare()
            t3 = time.perf_counter()
            if i >= 2:  # warm-up
                goodput_times.append(t1 - t0)
                bare_times.append(t3 - t2)
                poll_times.append(t1p - t1)
        return {"goodput": statistics.median(goodput_times), "bare": statistics.median(bare_times),
                "poll": statistics.median(poll_times), "goodput_steps": goodput_times, "bare_steps": bare_times}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--meshes", nargs="+", default=["2,1,1", "2,2,2"])
    opts = parser.parse_args()
    figures = []
    for text in opts.meshes:
        mesh = tuple(int(x) for x in text.split(","))
        results = run_ranks(measure, mesh[0] * mesh[1] * mesh[2], timeout_s=1800, mesh=mesh, steps=opts.steps)
        # The step ends when the slowest rank ends: compare the slowest rank's medians.
        goodput = max(r["goodput"] for r in results)
        bare = max(r["bare"] for r in results)
        poll = max(r["poll"] for r in results)
        print(f"mesh dp{mesh[0]} pp{mesh[1]} tp{mesh[2]}: goodput step {goodput * 1e3:.1f} ms, "
              f"bare torch loop {bare * 1e3:.1f} ms, ratio {goodput / bare:.3f} (target <= 1.05); "
              f"stop look {poll * 1e3:.2f} ms a step, (step + look) / step {(goodput + poll) / goodput:.4f}", flush=True)
        name = f"dp{mesh[0]} pp{mesh[1]} tp{mesh[2]}"
        # per interleaved step: the slowest rank's goodput step over the slowest rank's bare step
        ratios = [max(r["goodput_steps"][i] for r in results) / max(r["bare_steps"][i] for r in results)
                  for i in range(opts.steps)]
        figures += [records.figure(f"{name}: goodput step / bare torch step", ratios, "ratio", goal="<= 1.05"),
                    records.figure(f"{name}: goodput step", [max(r["goodput_steps"][i] for r in results) * 1e3
                                                             for i in range(opts.steps)], "ms"),
                    records.figure(f"{name}: look for a stop, per step (slowest rank's median)", [poll * 1e3], "ms")]
    records.write("trainer_overhead", figures, code=["trainer/train.py", "trainer/probes.py", "trainer/parallel.py",
                                                     "trainer/provider.py", "trainer/optim.py", "trainer/stop.py"])


if __name__ == "__main__":
    main()
