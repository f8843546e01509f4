"""Every single-device measurement of goodput's GPU path, one command, one process, under 8 minutes
on one CUDA GPU. Writes OUT/gpu_suite.md (figure, median, range, n, goal), OUT/gpu_suite.json (the
benchmark record, with each measurement's status, time and detail) and the same record in
benchmarks/records/gpu_suite.json.

    python benchmarks/gpu_suite.py --out DIR [--layers N] [--tmp DIR]
    python benchmarks/gpu_suite.py --out DIR --dry-run

1. mfu: the llama3-8b preset's width (d_model 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256)
   with as many blocks as the free device memory holds for two copies and their AdamW state
   (`layers_that_fit`; --layers N sets it): goodput's Trainer step (probes on, as a run has them) against a bare
   hand-written torch loop of the same weights (benchmarks/gpu_path.py's), step for step; eager,
   then both again compiled (train.compile). MFU = model FLOPs per step / (step time x the GPU's
   dense bf16 peak, `PEAK_BF16`); on a GPU not in that table: achieved TFLOP/s, MFU unknown.
2. overhead: goodput's step with probes, an async checkpoint to local disk every few steps and a
   peer snapshot every step (into page-locked host memory) / the bare step, in alternating blocks
   (gpu_path.alternate) so that drift, and the work one loop leaves running, hit both alike.
3. d2h: a peer snapshot's device-to-host GB/s / a plain `tensor.to("cpu", non_blocking=True)` (into
   pinned memory) of the same tensors, alternating.
4. stall: the time an async save holds the loop / a synchronous save of the same state.
5. abort: a size-1 NCCL group built, used (one all-reduce) and aborted 100 times through
   trainer/abandon.py: threads, open files and device memory before and after, and no round hangs
   (benchmarks/nccl_abort.py's check; a hang ends the suite after writing what it has).

2-4 train a smaller model (width 2048, 4 blocks, 0.33B parameters): a snapshot every step of the
8B-wide state (tens of GB) would need four times that in host memory, and its checkpoints would
outlast the suite. What a snapshot every step costs is state bytes over compute per step, which
depends on the tokens per step, not on the model: figure 2 holds for this batch (32k tokens).

Each measurement is guarded: one that fails records its error, the others still run, and the exit
status is then 1. --dry-run runs the same code on CPU (gloo, float32, the llama3-tiny shapes: 2
blocks, d_model 64; few steps and rounds; torch.compile through the aot_eager backend: the graphs
are traced as on a GPU, no C++ is compiled) and sends the record to --out, never to
benchmarks/records/.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import gpu_path, nccl_abort, records  # noqa: E402
from trainer.config import (  # noqa: E402
    DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig, model_from_dict, state_fingerprint,
)
from trainer.parallel import DeviceChoice, build_mesh, choose_device, init_process_group  # noqa: E402
from trainer.presets import preset_fields  # noqa: E402

PEAK_BF16: tuple[tuple[str, float], ...] = (
    (r"H100.*(SXM|HBM3)", 989e12),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"H200(?!.*NVL)", 989e12),
    (r"A100", 312e12),
)
"""Dense bf16 FLOP/s by device name (a pattern in torch.cuda.get_device_name), NVIDIA's data sheets.
The H100 PCIe and NVL and the H200 NVL are slower and not here: their MFU is unknown."""

NOT_MEASURABLE = (
    "The abort of a collective in flight across ranks (a survivor giving up an all-reduce its lost peer "
    "never joins): NCCL refuses two ranks on one device. tests/dist/test_abandon.py checks it on gloo.",
    "Tensor and pipeline parallelism over NVLink (TP's all-reduces, PP's sends and receives) and FSDP's "
    "all-gathers and reduce-scatters between GPUs: on one rank there is nobody to send to.",
    "A peer snapshot's exchange with its buddy on another node, and the probes' cross-rank fingerprint "
    "comparison: one rank has no buddy and no peer to compare with.",
)

CODE = ["trainer/train.py", "trainer/parallel.py", "trainer/provider.py", "trainer/model.py", "trainer/probes.py",
        "trainer/peer.py", "checkpointing/peer.py", "trainer/checkpoint.py", "trainer/abandon.py",
        "benchmarks/gpu_path.py", "benchmarks/nccl_abort.py", "benchmarks/gpu_suite.py"]
LIMIT_S = {False: 480.0, True: 60.0}
"""What the whole suite must take: on a GPU, and in a dry run on a small CPU machine."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What the suite runs: on a GPU (`GPU`) or in a dry run (`DRY`)."""

    wide: ModelConfig
    """Measurement 1's model; on a GPU its n_layers is `layers_that_fit`'s."""
    wide_name: str
    """Whose width it is, for the progress lines."""
    wide_batch: int
    """Measurement 1: samples per step."""
    wide_micro: int
    """Measurement 1: samples per micro-batch."""
    small: ModelConfig
    """Measurements 2-4's model."""
    small_batch: int
    """Measurements 2-4: samples per step."""
    small_micro: int
    """Measurements 2-4: samples per micro-batch."""
    warmup: int
    """Untimed steps of each loop first (kernels, allocator, Adam state, compilation)."""
    steps: int
    """Measurement 1: timed steps of each loop, interleaved one for one."""
    blocks: int
    """Measurement 2: blocks of each loop (ABBA ...)."""
    block: int
    """Measurement 2: steps per block, the first untimed."""
    save_every: int
    """Measurement 2: an async checkpoint every this many goodput steps."""
    copies: int
    """Measurement 3: pairs of copies."""
    saves: int
    """Measurement 4: pairs of saves."""
    rounds: int
    """Measurement 5: groups built, used and aborted."""
    round_timeout_s: float
    """Measurement 5: a round slower than this is a hang."""
    tokens: int
    """Tokens in the memory-mapped token file both models read."""
    budget_s: dict[str, float] = field(default_factory=dict)
    """Seconds each measurement is given (printed, and flagged when exceeded)."""


def preset_model(name: str, **fields: Any) -> ModelConfig:
    return model_from_dict({**preset_fields(name), **fields})


GPU = Sizes(wide=preset_model("llama3-8b", n_layers=1, seq_len=4096), wide_name="Llama-3-8B", wide_batch=4,
            wide_micro=1, small=ModelConfig(n_layers=4, d_model=2048, n_heads=16, vocab_size=32000, seq_len=2048),
            small_batch=16, small_micro=4, warmup=3, steps=10, blocks=4, block=4, save_every=8, copies=5, saves=3,
            rounds=100, round_timeout_s=60.0, tokens=8_000_000,
            budget_s={"mfu": 270, "overhead": 60, "d2h": 20, "stall": 60, "abort": 45})
DRY = Sizes(wide=preset_model("llama3-tiny", n_layers=2, seq_len=32), wide_name="llama3-tiny", wide_batch=4,
            wide_micro=2, small=preset_model("llama3-tiny", n_layers=2, seq_len=32), small_batch=4, small_micro=2,
            warmup=2, steps=3, blocks=2, block=2, save_every=2, copies=2, saves=1, rounds=10, round_timeout_s=30.0,
            tokens=65_536, budget_s={"mfu": 25, "overhead": 8, "d2h": 4, "stall": 6, "abort": 4})


def peak_bf16(device_name: str) -> float | None:
    return next((peak for pattern, peak in PEAK_BF16 if re.search(pattern, device_name)), None)


def layers_that_fit(model: ModelConfig, tokens: int, free_bytes: int, copies: int = 2) -> int:
    """Blocks of `model` that `free_bytes` of device memory hold for `copies` models at once (goodput's
    and the bare loop's), each with its AdamW state, while one of them trains on micro-batches of
    `tokens` tokens. Per parameter and copy: the fp32 weight, gradient and Adam's two moments (16
    bytes) and a bf16 working copy (FSDP's gathered one, autocast's cache: 2). Per token and block,
    the bf16 activations kept for the backward: 15 of d_model (block input, normed inputs, q, k and
    v, rotated and repeated for the grouped heads, attention out, and a margin: counted with saved-
    tensor hooks at Llama-3's head grouping, it was 14.3) and 4 of the ffn width (SwiGLU's w1, w3,
    their gate and product). Per token: the logits and their gradient in bf16 and fp32 and the
    log-softmax (16 bytes per vocabulary entry). 15 % of the free memory and 2 GiB stay free for
    the allocator's slack and the kernels' workspaces."""
    base = replace(model, n_layers=0).num_params()
    block = replace(model, n_layers=1).num_params() - base
    per_param = copies * (16 + 2)
    usable = 0.85 * free_bytes - 2 * 2**30 - 16 * tokens * model.vocab_size - per_param * base
    per_block = per_param * block + 2 * (15 * model.d_model + 4 * model.hidden_dim) * tokens
    return max(1, int(usable // per_block))


@dataclass
class Outcome:
    """What one measurement found, filled in as it goes: a measurement that fails midway keeps the
    figures it had (mfu's eager ones when compiling fails)."""

    figures: list[dict[str, Any]] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """What the measurement found wrong (a leak, a failed save): it counts as failed, figures kept."""


@dataclass
class Small:
    """Measurements 2-4's goodput trainer and the bare loop on its weights, built once."""

    config: TrainerConfig
    trainer: Any
    bare: Callable[[], float]
    sink: Any


def plain_copy(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a user writes to get tensors to the host: `.to("cpu", non_blocking=True)` each (from a
    GPU into page-locked memory from torch's caching host allocator; on CPU, a copy)."""
    return [t.to("cpu", non_blocking=True, copy=True) for t in sources]


class Suite:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.dry: bool = opts.dry_run
        self.sizes = DRY if self.dry else GPU
        self.out = Path(opts.out)
        self.start = time.perf_counter()
        self.results: dict[str, dict[str, Any]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="gpu-suite-", dir=opts.tmp)
        self.tmp = Path(self._tmp.name)
        self._small: Small | None = None
        if self.dry:
            self.choice = DeviceChoice(torch.device("cpu"), "gloo", torch.float32, torch.float32)
            init_process_group(rank=0, world_size=1, store=dist.HashStore(), backend="gloo", timeout_s=300)
            self.device_name = "cpu (dry run)"
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device here: run on a machine with one GPU, or pass --dry-run")
            self.choice = choose_device("auto")
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            init_process_group(rank=0, world_size=1, store=store, backend=self.choice.backend, timeout_s=600)
            self.device_name = torch.cuda.get_device_name(self.choice.device)
        self.cuda = self.choice.device.type == "cuda"
        # One token file for both models (ids below both vocabularies), memory-mapped as a run reads it.
        self.data_path = self.tmp / "tokens.bin"
        high = min(self.sizes.wide.vocab_size, self.sizes.small.vocab_size, 2**16)
        np.random.default_rng(0).integers(0, high, self.sizes.tokens, dtype=np.uint16).tofile(self.data_path)

    # -- plumbing ---------------------------------------------------------------------------------------
    def say(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {line}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.choice.device)

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def config(self, model: ModelConfig, batch: int, micro: int, *, compile: bool = False) -> TrainerConfig:
        return TrainerConfig(model=model, data=DataConfig(kind="tokens", path=str(self.data_path), seed=0),
                             train=TrainConfig(steps=10**6, global_batch=batch, micro_batch=micro, compile=compile,
                                               dtype="float32" if self.dry else "auto"),
                             mesh=MeshShape(), probes=ProbeConfig(sdc_every_steps=10))

    def trainer(self, config: TrainerConfig, sink: Any = None) -> Any:
        from trainer.train import Trainer

        return Trainer(config, build_mesh(config.mesh, self.choice.device.type), self.choice, sink=sink)

    def small(self) -> Small:
        if self._small is None:
            from trainer.report import ListSink

            s = self.sizes
            config = self.config(s.small, s.small_batch, s.small_micro)
            t0 = time.perf_counter()
            sink = ListSink()
            trainer = self.trainer(config, sink)
            self._small = Small(config, trainer, gpu_path.bare_step_fn(config, self.choice, like=trainer), sink)
            self.say(f"small model: {s.small.num_params() / 1e9:.2f}B parameters, {s.small_batch} x {s.small.seq_len} "
                     f"tokens per step, built in {time.perf_counter() - t0:.1f} s")
        return self._small

    def host_folder(self, name: str, nbytes: int) -> Path:
        """Where peer snapshots go: the node's tmpfs as in a run, where it has room, else local disk."""
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 1.25 * nbytes else self.tmp
        return Path(tempfile.mkdtemp(prefix=f"gpu-suite-{name}-", dir=root))

    def peers(self, name: str, small: Small) -> tuple[Any, Path]:
        from trainer.peer import PeerSnapshots

        state = 2 * 3 * small.config.model.num_params() * torch.finfo(self.choice.param_dtype).bits // 8
        folder = self.host_folder(name, state)
        return PeerSnapshots(folder=folder, run_id=f"suite-{name}", attempt=0, buddy=None, sink=small.sink,
                             identity=state_fingerprint(small.config.model), mesh=small.config.mesh.axes()), folder

    # -- one measurement, guarded ---------------------------------------------------------------------
    def run(self, name: str, title: str, measure: Callable[[Outcome], None]) -> None:
        budget = self.sizes.budget_s[name]
        self.say(f"== {name}: {title} (budget {budget:.0f} s)")
        entry: dict[str, Any] = {"title": title, "budget_s": budget, "status": "running", "figures": [],
                                 "error": None}
        self.results[name] = entry
        t0 = time.perf_counter()
        outcome = Outcome()
        try:
            measure(outcome)
        except Exception as e:  # noqa: BLE001 - recorded as this measurement's failure; the others still run
            outcome.problems.append(f"{type(e).__name__}: {e}")
            entry["traceback"] = traceback.format_exc()
            print(entry["traceback"], flush=True)
        entry.update(status="failed" if outcome.problems else "ok", figures=outcome.figures, detail=outcome.detail,
                     error="; ".join(outcome.problems) or None)
        entry["seconds"] = time.perf_counter() - t0
        entry["over_budget"] = entry["seconds"] > budget
        self.release()
        for f in entry["figures"]:
            self.say(f"  {f['figure']}: median {f['median']:.4g} {f['unit']} (n={f['n']})")
        self.say(f"{name}: {entry['status']}{' (' + entry['error'] + ')' if entry['error'] else ''} in "
                 f"{entry['seconds']:.1f} s of its {budget:.0f} s{' (OVER BUDGET)' if entry['over_budget'] else ''}")

    # -- 1 ---------------------------------------------------------------------------------------------
    def mfu(self, out: Outcome) -> None:
        s = self.sizes
        tokens = s.wide_batch * s.wide.seq_len
        detail = out.detail
        detail["device"] = self.device_name
        if self.opts.layers:
            layers = self.opts.layers
        elif self.dry:
            layers = s.wide.n_layers
        else:
            free, total = torch.cuda.mem_get_info(self.choice.device)
            layers = layers_that_fit(s.wide, s.wide_micro * s.wide.seq_len, free)
            detail.update(free_bytes=free, total_bytes=total)
        model = replace(s.wide, n_layers=layers)
        flops = gpu_path.model_flops_per_step(model, tokens)
        peak = peak_bf16(self.device_name)
        unknown = None if peak else f"no dense bf16 peak on file for {self.device_name}"
        detail.update(layers=layers, params=model.num_params(), tokens_per_step=tokens, flops_per_step=flops,
                      peak_bf16=peak, mfu_unknown=unknown)
        self.say(f"{layers} blocks of {s.wide_name} width: {model.num_params() / 1e9:.2f}B parameters, "
                 f"{s.wide_batch} x {model.seq_len} tokens per step, {flops / 1e12:.1f} TFLOP per step; peak "
                 f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown: MFU unknown, achieved TFLOP/s instead'}")
        for compiled in (False, True):
            label = "compiled" if compiled else "eager"
            config = self.config(model, s.wide_batch, s.wide_micro, compile=compiled)
            t0 = time.perf_counter()
            goodput = self.trainer(config)
            bare = gpu_path.bare_step_fn(config, self.choice, like=goodput)
            built = time.perf_counter() - t0
            self.say(f"{label}: both models built in {built:.1f} s; {s.warmup} warm-up steps each")
            t0 = time.perf_counter()
            for _ in range(s.warmup):
                goodput.train_step()
                bare()
            warm = time.perf_counter() - t0
            g: list[float] = []
            b: list[float] = []
            for _ in range(s.steps):
                t1 = time.perf_counter()
                goodput.train_step()
                g.append(time.perf_counter() - t1)
                b.append(bare())
            del goodput, bare
            if compiled:
                torch._dynamo.reset()  # the compiled blocks' code holds on to the modules
            self.release()
            detail[label] = {"build_s": built, "warmup_s": warm, "goodput_s": g, "bare_s": b,
                             "device_bytes_left": torch.cuda.memory_allocated(self.choice.device) if self.cuda else 0}
            self.say(f"{label}: warm-up {warm:.1f} s; goodput {statistics.median(g) * 1e3:.1f} ms/step, bare "
                     f"{statistics.median(b) * 1e3:.1f} ms/step")
            for who, times in (("goodput step", g), ("bare torch step", b)):
                if peak:
                    out.figures.append(records.figure(f"mfu: {who}, {label}", [100 * flops / t / peak for t in times],
                                                      "% MFU"))
                else:
                    out.figures.append(records.figure(f"mfu: {who}, {label}, achieved (MFU unknown)",
                                                      [flops / t / 1e12 for t in times], "TFLOP/s"))
            out.figures.append(records.figure(f"mfu: goodput step / bare step, {label}", [x / y for x, y in zip(g, b)],
                                              "ratio", goal="<= 1.03"))

    # -- 2 ---------------------------------------------------------------------------------------------
    def overhead(self, out: Outcome) -> None:
        from checkpointing.store.local import LocalStore
        from trainer.checkpoint import Checkpointer

        s, small = self.sizes, self.small()
        trainer, sink = small.trainer, small.sink
        peers, folder = self.peers("overhead", small)
        ckpt = Checkpointer(LocalStore(self.tmp / "store"), run_id="overhead", attempt=0, keep=1, sink=sink,
                            staging_dir=self.tmp / "stage", use_async=True)
        stalls: list[float] = []
        done = [0]

        def goodput_step() -> None:  # as trainer/worker.py's loop: step, snapshot, report, checkpoint when due
            report = trainer.train_step()
            peers.take(trainer, [report])
            peers.deliver(functools.partial(sink.report, report))
            done[0] += 1
            if done[0] % s.save_every == 0:
                stalls.append(ckpt.save(trainer).blocked_s)

        try:
            for _ in range(2):  # both snapshot slots laid out and page-locked, then the staging buffers made
                trainer.train_step()
                peers.take(trainer)
                small.bare()
            ckpt.save(trainer)
            ckpt.wait()
            g, b = gpu_path.alternate(goodput_step, small.bare, s.blocks, s.block, self.sync)
            ckpt.wait()
        finally:
            ckpt.close()
            peers.close()
            shutil.rmtree(folder, ignore_errors=True)
        out.problems += [f"{kind}: {d}" for kind, d in sink.events
                         if kind in ("checkpoint_failed", "peer_snapshot_failed")]
        flags = [kind for kind, _ in sink.events if kind in ("sdc_suspect", "sdc_transient", "loss_anomaly")]
        what = f"probes, async checkpoint every {s.save_every}, peer snapshot every step"
        # goal: gpu_path's two, together: probes and async saves <= 1.03, a snapshot every step <= 1.02
        out.figures += [records.figure(f"overhead: goodput step ({what}) / bare step", [x / y for x, y in zip(g, b)],
                                       "ratio", goal="<= 1.05"),
                        records.figure("overhead: goodput step", [x * 1e3 for x in g], "ms"),
                        records.figure("overhead: bare torch step", [x * 1e3 for x in b], "ms")]
        out.detail.update(save_stalls_s=stalls, snapshot_folder=str(folder.parent), probe_flags=flags)

    # -- 3 ---------------------------------------------------------------------------------------------
    def d2h(self, out: Outcome) -> None:
        from trainer.peer import lay_out

        s, small = self.sizes, self.small()
        trainer = small.trainer
        sources = lay_out(trainer)[0].sources
        nbytes = sum(t.numel() * t.element_size() for t in sources)
        peers, folder = self.peers("d2h", small)
        snap_s: list[float] = []
        plain_s: list[float] = []
        try:
            peers.take(trainer)  # both slots laid out and page-locked, the host allocator's blocks made
            peers.take(trainer)
            plain_copy(sources)
            for _ in range(s.copies):
                peers.wait()
                self.sync()
                t0 = time.perf_counter()
                peers.take(trainer)
                self.sync()  # (the side stream's copy too)
                snap_s.append(time.perf_counter() - t0)
                peers.wait()
                t0 = time.perf_counter()
                copies = plain_copy(sources)
                self.sync()
                plain_s.append(time.perf_counter() - t0)
                del copies
        finally:
            peers.close()
            shutil.rmtree(folder, ignore_errors=True)
        gb = nbytes / 1e9
        # goal: the snapshot's is a plain copy into page-locked memory too, only into a file's mapping
        out.figures += [records.figure("d2h: peer snapshot, device to host", [gb / t for t in snap_s], "GB/s"),
                        records.figure("d2h: plain .to('cpu', non_blocking=True)", [gb / t for t in plain_s], "GB/s"),
                        records.figure("d2h: peer snapshot / plain copy", [p / q for q, p in zip(snap_s, plain_s)],
                                       "ratio", goal=">= 0.9")]
        out.detail.update(bytes=nbytes, tensors=len(sources))

    # -- 4 ---------------------------------------------------------------------------------------------
    def stall(self, out: Outcome) -> None:
        from checkpointing.store.local import LocalStore
        from trainer.checkpoint import Checkpointer

        small = self.small()
        trainer, sink = small.trainer, small.sink
        store = LocalStore(self.tmp / "stall")
        sync = Checkpointer(store, run_id="stall-sync", attempt=0, keep=1, sink=sink, staging_dir=self.tmp / "s1",
                            use_async=False)
        asyn = Checkpointer(store, run_id="stall-async", attempt=0, keep=1, sink=sink, staging_dir=self.tmp / "s2",
                            use_async=True)
        try:
            trainer.train_step()
            asyn.save(trainer)  # its staging buffers made once per attempt, not at every save
            asyn.wait()
            sync_s, async_s = gpu_path.save_pairs(trainer, sync, asyn, self.sizes.saves, self.sync)
        finally:
            sync.close()
            asyn.close()
        out.problems += [f"checkpoint_failed: {d}" for kind, d in sink.events if kind == "checkpoint_failed"]
        out.figures += [records.figure("stall: async save stall / synchronous save",
                                       [a / y for a, y in zip(async_s, sync_s)], "ratio", goal="<= 0.02"),
                        records.figure("stall: async save, loop held", async_s, "s"),
                        records.figure("stall: synchronous save", sync_s, "s")]

    # -- 5 ---------------------------------------------------------------------------------------------
    def abort(self, out: Outcome) -> None:
        s = self.sizes
        result = nccl_abort.run_rounds(s.rounds, self.choice.device, s.round_timeout_s, on_hang=self.hung,
                                       say=lambda line: self.say("  " + line))
        threads, files, device = result["kept"]
        backend = "NCCL" if self.cuda else "gloo"
        out.figures += [records.figure(f"abort: one round ({backend} group built, all-reduce, abort)",
                                       result["round_s"], "s"),
                        records.figure("abort: threads kept after the rounds", [threads], "threads",
                                       goal=f"<= {nccl_abort.LEAK_THREADS}"),
                        records.figure("abort: open files kept after the rounds", [files], "files",
                                       goal=f"<= {nccl_abort.LEAK_FILES}"),
                        records.figure("abort: device memory kept after the rounds", [device / 2**20], "MiB",
                                       goal=f"<= {nccl_abort.LEAK_BYTES // 2**20}")]
        out.detail.update(backend=backend, **{k: result[k] for k in ("before", "after", "held", "warm_up_s")})
        if result["leaks"]:
            out.problems.append(f"LEAK: {', '.join(result['leaks'])} grew past the bound")

    def hung(self, round_: int, timeout_s: float) -> None:
        """A round hung (the watchdog's thread): what the suite has is written, then the process ends."""
        self.results["abort"].update(status="failed", error=f"HANG: round {round_} took over {timeout_s:g} s")
        self.finish()
        nccl_abort.end_on_hang(round_, timeout_s)

    # -- the outputs -----------------------------------------------------------------------------------
    def finish(self) -> bool:
        """Write the table and the record; whether every measurement passed."""
        seconds = time.perf_counter() - self.start
        limit = LIMIT_S[self.dry]
        figures = [f for entry in self.results.values() for f in entry["figures"]]
        measurements = {name: {**{k: v for k, v in entry.items() if k != "figures"},
                               "figures": [f["figure"] for f in entry["figures"]]}
                        for name, entry in self.results.items()}
        extra = {"dry_run": self.dry, "device": self.device_name, "seconds": seconds, "limit_s": limit,
                 "measurements": measurements, "not_measurable": list(NOT_MEASURABLE)}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_suite.md").write_text(markdown(self.device_name, self.dry, seconds, limit, self.results))
        # OUT/gpu_suite.json is the record itself; a GPU run also files it with the others (a dry
        # run's GOODPUT_RECORDS_DIR is OUT: one file).
        folders = {self.out.resolve(), Path(os.environ.get(records.ENV_DIR) or records.RECORDS).resolve()}
        for folder in sorted(folders):
            records.write("gpu_suite", figures, code=CODE, extra=extra, directory=folder)
        return all(entry["status"] == "ok" for entry in self.results.values())

    def close(self) -> None:
        self._small = None
        self.release()
        dist.destroy_process_group()
        self._tmp.cleanup()


def _number(v: float) -> str:
    return f"{v:.4g}"


def markdown(device: str, dry: bool, seconds: float, limit: float, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"# GPU suite: {device}", ""]
    if dry:
        lines += ["A dry run: the same code on CPU with tiny shapes. Its numbers say nothing about a GPU.", ""]
    lines += [f"{seconds:.0f} s in all (limit {limit:.0f} s); torch {torch.__version__}.", "",
              "| figure | median | range | n | goal |", "|---|---|---|---|---|"]
    for entry in results.values():
        for f in entry["figures"]:
            unit = "" if f["unit"] == "ratio" else f" {f['unit']}"
            lines.append(f"| {f['figure']} | {_number(f['median'])}{unit} | {_number(f['min'])} – "
                         f"{_number(f['max'])} | {f['n']} | {f.get('goal', '')} |")
    lines += ["", "## Measurements", ""]
    for name, entry in results.items():
        state = "ok" if entry["status"] == "ok" else f"**{entry['status'].upper()}**: {entry['error']}"
        took = f"{entry['seconds']:.0f} s of" if "seconds" in entry else "unfinished; budget"
        over = " **over budget**" if entry.get("over_budget") else ""
        lines.append(f"- {name} ({entry['title']}): {state}; {took} {entry['budget_s']:.0f} s{over}")
    lines += ["", "## Not measurable on one GPU", ""] + [f"- {why}" for why in NOT_MEASURABLE]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_suite.md and gpu_suite.json")
    parser.add_argument("--dry-run", action="store_true", help="the same code on CPU, tiny shapes (< 60 s)")
    parser.add_argument("--layers", type=int, default=0, help="measurement 1's blocks (default: as many as fit)")
    parser.add_argument("--tmp", default=os.environ.get("GOODPUT_BENCH_DIR"), help="scratch folder (local disk)")
    opts = parser.parse_args()
    if opts.dry_run:
        os.environ[records.ENV_DIR] = str(Path(opts.out).resolve())  # never over the real records
        torch.set_num_threads(1)  # (a busy small machine: intra-op threads waiting on each other cost 10x)
        if hasattr(torch._dynamo.config, "debug_backend_override"):  # inductor's C++ would take minutes on CPU
            torch._dynamo.config.debug_backend_override = ">=0:aot_eager"
    suite = Suite(opts)
    sizes = suite.sizes
    passed = False
    suite.say(f"{suite.device_name}; torch {torch.__version__}; budgets: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in sizes.budget_s.items())
              + f" (all: {sum(sizes.budget_s.values()):.0f} s of {LIMIT_S[suite.dry]:.0f} s)")
    try:
        suite.run("mfu", "MFU, goodput's step and a bare torch loop, eager and compiled", suite.mfu)
        suite.run("overhead", "goodput step with probes, async checkpoint and peer snapshot / bare step",
                  suite.overhead)
        suite.run("d2h", "peer snapshot device-to-host GB/s / plain .to('cpu', non_blocking=True)", suite.d2h)
        suite.run("stall", "async save stall / synchronous save", suite.stall)
        suite.run("abort", f"{sizes.rounds} size-1 groups built, used and aborted (trainer/abandon.py)", suite.abort)
        passed = suite.finish()
    finally:
        suite.close()
    print(Path(opts.out, "gpu_suite.md").read_text(), flush=True)
    failed = [name for name, entry in suite.results.items() if entry["status"] != "ok"]
    print(f"gpu_suite: {'FAILED: ' + ', '.join(failed) if failed else 'every measurement passed'}; "
          f"{time.perf_counter() - suite.start:.1f} s (limit {LIMIT_S[suite.dry]:.0f} s)", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
