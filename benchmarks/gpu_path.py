"""The GPU path on one rank (needs a CUDA device): goodput's trainer on a ~1B-parameter model (bf16
compute through FSDP2's mixed precision, SDPA attention, fused AdamW) against a bare hand-written torch
loop of the same model, interleaved in one process so clock and thermal drift hit both alike.

Prints:
- MFU of the bare loop and of goodput's step (model FLOPs / H100 SXM bf16 dense peak, 989 TFLOP/s);
- goodput step time with probes and an async checkpoint every `--every` steps / the bare loop (goal <= 1.03);
- async save stall / synchronous save of the same state to local disk (goal <= 0.02);
- goodput step time with a peer snapshot every step / without (goal <= 1.02): blocks of `--block`
  steps alternating ABBA, `--blocks` of each, every step timed from its start to the next one's
  (the snapshot's stall and its side-stream copy are both in it), a block's first step left out;
- what a kill-rank recovery costs, term by term: process start (interpreter + `import torch`), CUDA
  init, NCCL process-group init (fresh processes each, `--repeat` times), checkpoint load from local
  disk and, with `--s3`, from an S3-protocol server (moto) on the same host, and the first step after.

    python benchmarks/gpu_path.py [--layers 16 --d-model 2048 --seq 2048 --batch 8 --steps 20] [--s3]

(benchmarks/gpu_suite.py runs its pieces too: bare_step_fn, alternate, save_pairs, model_flops_per_step.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.config import DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig  # noqa: E402

PEAK_BF16 = 989.4e12
"""H100 SXM dense bf16 FLOP/s (the figure MFU is quoted against)."""


def model_flops_per_step(cfg: ModelConfig, tokens: int) -> float:
    """6 N per token for the matmul parameters (the embedding lookup is no matmul) plus attention's
    12 L d s per token (forward and backward of QK^T and AV), as in the PaLM appendix."""
    params = cfg.num_params() - cfg.vocab_size * cfg.d_model
    return tokens * (6 * params + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len)


def bare_step_fn(cfg: TrainerConfig, choice: Any, like: Any = None) -> Callable[[], float]:
    """What a user writes by hand with torch alone: the same model class, autocast to the compute
    dtype where it differs from the parameters' (bf16 on a GPU), AdamW (fused on a GPU). Its weights
    are `like`'s (a Trainer on one rank: the same values, no second initialisation) or, without it,
    initialised from the same seed as goodput's. Returns a step function that returns its seconds."""
    from trainer.data import build_source
    from trainer.model import Transformer
    from trainer.tensors import local_tensor

    device, compute = choice.device, choice.compute_dtype
    autocast = compute != choice.param_dtype
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    model.to(choice.param_dtype)
    if like is None:
        model.init_weights(cfg.train.seed)
    else:
        theirs = dict(like.parts[0].named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(local_tensor(theirs[name]))
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=True if device.type == "cuda" else None)
    source = build_source(cfg.data, cfg.model)
    cursor = [0]
    n_micro = cfg.train.global_batch // cfg.train.micro_batch

    def step() -> float:
        t0 = time.perf_counter()
        ids = list(range(cursor[0], cursor[0] + cfg.train.global_batch))
        rows = torch.from_numpy(source.batch(ids)).to(device)
        for inp, tgt in zip(rows[:, :-1].chunk(n_micro), rows[:, 1:].chunk(n_micro)):
            with torch.autocast(device.type, dtype=compute, enabled=autocast):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()) / n_micro
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the loop's one sync, as a user's logging would do
        cursor[0] += cfg.train.global_batch
        del loss_value
        return time.perf_counter() - t0

    return step


def alternate(a: Callable[[], object], b: Callable[[], object], blocks: int, block: int,
              sync: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Step times of two loops run in alternating blocks of `block` steps, `blocks` of each (ABBA
    ...): each step from its start to the next one's start (work it left running in the background
    is in it), a block's first step left out (it still pays for the other loop's)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    starts: list[tuple[bool, bool, float]] = []
    for k in range(2 * blocks):
        first_loop = (k % 2 == 0) == (k // 2 % 2 == 0)
        for i in range(block):
            starts.append((first_loop, i == 0, time.perf_counter()))
            (a if first_loop else b)()
    sync()
    starts.append((False, True, time.perf_counter()))
    for (which, first, start), (_, _, nxt) in zip(starts, starts[1:]):
        if not first:
            times[which].append(nxt - start)
    return times[True], times[False]


def snapshot_cost(trainer: "object", folder: Path, blocks: int, block: int) -> tuple[list[float], list[float]]:
    """Step times with a peer snapshot after every step and without, in alternating blocks (ABBA ...):
    each step from its start to the next one's start, a block's first step left out (it still pays
    for the other regime). One rank: its own copies only (the buddy's exchange is host-side)."""
    from trainer.peer import PeerSnapshots
    from trainer.report import ListSink

    t: "object" = trainer
    peers = PeerSnapshots(folder=folder, run_id="gpu", attempt=0, buddy=None, sink=ListSink(), identity="gpu",
                          mesh=t.config.mesh.axes())  # type: ignore[attr-defined]
    peers.take(t)  # lay out and page-lock both slots before timing
    peers.take(t)

    def with_snapshot() -> None:
        t.train_step()  # type: ignore[attr-defined]
        peers.take(t)

    steps = t.train_step  # type: ignore[attr-defined]
    on, off = alternate(with_snapshot, steps, blocks, block, torch.cuda.synchronize)
    peers.close()
    return on, off


def fresh_process_costs(repeat: int) -> dict[str, list[float]]:
    """Process start, CUDA init and NCCL init, each measured in a fresh interpreter (as a restarted rank pays them)."""
    code = r"""
import time, os, sys
t0 = time.perf_counter()
import torch, torch.distributed as dist
t1 = time.perf_counter()
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(1, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
t3 = time.perf_counter()
dist.destroy_process_group()
print(f"{t1 - t0} {t2 - t1} {t3 - t2}")
"""
    out: dict[str, list[float]] = {"interpreter": [], "import_torch": [], "cuda_init": [], "nccl_init": []}
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        imp, cuda, nccl = (float(v) for v in proc.stdout.split())
        out["import_torch"].append(imp)
        out["cuda_init"].append(cuda)
        out["nccl_init"].append(nccl)
        out["interpreter"].append(max(0.0, wall - imp - cuda - nccl))
    return out


def save_pairs(trainer: Any, sync: Any, asyn: Any, saves: int,
               settle: Callable[[], None]) -> tuple[list[float], list[float]]:
    """`saves` pairs of a synchronous save (the whole save) and an async one (the time `save()` holds
    the loop), each of a new step; the async one written out before the next pair."""
    sync_s: list[float] = []
    async_s: list[float] = []
    for _ in range(saves):
        for checkpointer, into in ((sync, sync_s), (asyn, async_s)):
            trainer.train_step()
            settle()
            into.append(checkpointer.save(trainer).blocked_s)
        asyn.wait()
    return sync_s, async_s


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def main() -> None:
    from checkpointing.manifest import read_manifest
    from checkpointing.store import LocalStore
    from trainer.checkpoint import Checkpointer
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.report import ListSink
    from trainer.train import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each loop")
    parser.add_argument("--every", type=int, default=10, help="async checkpoint interval of goodput's loop")
    parser.add_argument("--saves", type=int, default=3, help="sync and async saves compared")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes for the start-up costs")
    parser.add_argument("--s3", action="store_true", help="also load from moto on 127.0.0.1")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block, in both loops")
    parser.add_argument("--s3-repeat", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=6, help="peer snapshot cost: blocks of each regime")
    parser.add_argument("--block", type=int, default=4, help="peer snapshot cost: steps per block")
    parser.add_argument("--tokens", type=int, default=50_000_000, help="tokens in the data file")
    parser.add_argument("--dir", default=os.environ.get("GOODPUT_BENCH_DIR"))
    opts = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"

    tmpdir = tempfile.TemporaryDirectory(dir=opts.dir)
    tmp = Path(tmpdir.name)
    # A memory-mapped token file, as a real run reads (the synthetic Markov source builds a dense
    # vocab x vocab chain: at 32k tokens its sampling, not the GPU, would set the pace).
    data_path = tmp / "tokens.bin"
    np.random.default_rng(0).integers(0, 32000, opts.tokens, dtype=np.uint16).tofile(data_path)
    data = DataConfig(kind="tokens", path=str(data_path), seed=0)
    model = ModelConfig(n_layers=opts.layers, d_model=opts.d_model, n_heads=opts.heads, vocab_size=32000,
                        seq_len=opts.seq)
    train = TrainConfig(steps=10**6, global_batch=opts.batch, micro_batch=opts.micro, compile=opts.compile)
    on = TrainerConfig(model=model, data=data, train=train, mesh=MeshShape(),
                       probes=ProbeConfig(sdc_every_steps=10))
    choice = choose_device("auto")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    init_process_group(rank=0, world_size=1, store=store, backend=choice.backend, timeout_s=600)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {model.num_params() / 1e9:.2f}B params; "
          f"{opts.batch} x {opts.seq} tokens per step; compute {choice.compute_dtype}"
          f"{'; torch.compile per block' if opts.compile else ''}", flush=True)
    sink = ListSink()
    goodput = Trainer(on, build_mesh(on.mesh, "cuda"), choice, sink=sink)
    bare = bare_step_fn(on, choice)
    flops = model_flops_per_step(model, opts.batch * opts.seq)

    with tmpdir:
        local = LocalStore(tmp / "store")
        ckpt = Checkpointer(local, run_id="gpu", attempt=0, keep=1, sink=sink, staging_dir=tmp / "stage",
                            use_async=True)
        for _ in range(3):  # warm-up: kernels, allocator, Adam state, the first staging buffers
            goodput.train_step()
            bare()
        ckpt.save(goodput)
        ckpt.wait()
        torch.cuda.synchronize()
        g_times: list[float] = []
        b_times: list[float] = []
        stalls: list[float] = []
        for i in range(opts.steps):  # interleaved one for one
            t0 = time.perf_counter()
            goodput.train_step()
            if goodput.step % opts.every == 0:
                stalls.append(ckpt.save(goodput).blocked_s)
            g_times.append(time.perf_counter() - t0)
            b_times.append(bare())
        ckpt.wait()
        g, b = statistics.median(g_times), statistics.median(b_times)
        print(f"bare torch loop:   median {b * 1e3:.1f} ms/step; MFU {flops / b / PEAK_BF16:.1%}")
        print(f"goodput (probes, async save every {opts.every}): median {g * 1e3:.1f} ms/step, mean "
              f"{statistics.mean(g_times) * 1e3:.1f}; MFU {flops / g / PEAK_BF16:.1%}; saves stalled {stalls}")
        print(f"ratio goodput / bare = {g / b:.3f} (median; mean {statistics.mean(g_times) / statistics.mean(b_times):.3f}; "
              "goal <= 1.03)", flush=True)

        sync = Checkpointer(local, run_id="gpu-sync", attempt=0, keep=1, sink=sink, staging_dir=tmp / "s2",
                            use_async=False)
        sync_s, async_s = save_pairs(goodput, sync, ckpt, opts.saves, torch.cuda.synchronize)
        print(f"synchronous save: {med(sync_s)}; async stall: {med(async_s)}; ratio "
              f"{statistics.median(async_s) / statistics.median(sync_s):.4f} (goal <= 0.02)", flush=True)
        failed = [d for k, d in sink.events if k == "checkpoint_failed"]
        assert not failed, failed
        with_s, without_s = snapshot_cost(goodput, tmp / "peer", opts.blocks, opts.block)
        ratio = statistics.median(with_s) / statistics.median(without_s)
        print(f"peer snapshot every step: median {statistics.median(with_s) * 1e3:.1f} ms/step, without "
              f"{statistics.median(without_s) * 1e3:.1f}; ratio {ratio:.3f} "
              f"(median; mean {statistics.mean(with_s) / statistics.mean(without_s):.3f}; n = {len(with_s)} each; "
              "goal <= 1.02)", flush=True)

        step = goodput.step
        manifest = read_manifest(local, "gpu", step)
        del bare
        restored = Trainer(TrainerConfig(model=model, data=data, train=train, mesh=MeshShape(),
                                         probes=ProbeConfig(sdc_every_steps=10)),
                           build_mesh(on.mesh, "cuda"), choice, attempt=1)
        timed_loads("local disk", restored, local, manifest, opts.repeat)
        if opts.s3:
            s3_load(restored, local, manifest, tmp, opts.s3_repeat)
        restored.step, restored.cursor = step, manifest.cursor
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        restored.train_step()
        torch.cuda.synchronize()
        print(f"first step after the load: {time.perf_counter() - t0:.3f} s (steady state {g:.3f} s)", flush=True)
        ckpt.close()
        sync.close()
    dist.destroy_process_group()
    costs = fresh_process_costs(opts.repeat)
    for name, xs in costs.items():
        print(f"{name:>13}: {med(xs)}")


def timed_loads(where: str, trainer, store, manifest, repeat: int) -> None:
    """Load the step `repeat` times into the trainer; print the median and the rate."""
    from trainer.restore import load

    times: list[float] = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        load(trainer, store, manifest)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gib = manifest.total_bytes() / 2**30
    print(f"checkpoint load, {where} ({gib:.1f} GiB): {med(times)}; {gib / statistics.median(times):.2f} GiB/s",
          flush=True)


def s3_load(trainer, local, manifest, tmp: Path, repeat: int) -> None:
    """The same step uploaded to moto in server mode on 127.0.0.1, then loaded from there."""
    from checkpointing.manifest import MANIFEST, step_prefix
    from checkpointing.store import S3Store
    from tests.support.s3 import S3Server, restore_env, set_env

    (tmp / "moto").mkdir()
    server = S3Server(tmp / "moto")
    saved = set_env({**server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}"})  # no proxy
    try:
        server.create_bucket("bench")
        store = S3Store("bench", "ckpt")
        prefix = step_prefix(manifest.run_id, manifest.step)
        for rel in [*manifest.files, MANIFEST]:
            store.put_file(f"{prefix}/{rel}", Path(local.root) / prefix / rel)
        timed_loads("S3 protocol on this host", trainer, store, manifest, repeat)
    finally:
        restore_env(saved)
        server.stop()


if __name__ == "__main__":
    main()
