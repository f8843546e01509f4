"""A whole checkpoint save to S3 / a raw parallel upload of the same bytes, side by side.

Starts moto's S3 server on 127.0.0.1. One rank (gloo, CPU) holds a model of about --mparams million
parameters with its AdamW state. Each round, alternately (ABAB...):
- goodput: `Checkpointer.save` of a new step to an `S3Store`, timed until it is committed: stage to
  host memory, DCP write to the staging dir, sha256 of every file, multipart upload, rank marker,
  manifest (the commit), retention;
- raw: the same files (a DCP save of the same state to a local dir, made before the clock starts)
  uploaded with boto3's `upload_file`, all files at once in a thread pool, the same part size and
  concurrency per file: what the bytes alone cost on this server.
Prints both throughputs (median, spread, n) and the ratio goodput / raw: what the checkpoint protocol
costs over moving its bytes. The old benchmark compared `S3Store.put_file` with the `upload_file` it
calls (a ratio of ~1 by construction).

    python benchmarks/s3_throughput.py [--rounds 5] [--mparams 10]

Its record: benchmarks/records/s3_throughput.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from tests.support.s3 import S3Server, free_port, restore_env, set_env  # noqa: E402

PART = 16 * 2**20
CONCURRENCY = 8


def main() -> None:
    import boto3
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from boto3.s3.transfer import TransferConfig

    from checkpointing.manifest import latest_verified
    from checkpointing.store import S3Store
    from trainer.checkpoint import Checkpointer, trainer_state
    from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.report import ListSink
    from trainer.train import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mparams", type=float, default=10.0, help="model size, millions of parameters")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    d_model = 384
    layers = max(1, round(opts.mparams * 1e6 / (12 * d_model * d_model)))
    config = TrainerConfig(model=ModelConfig(n_layers=layers, d_model=d_model, n_heads=6, vocab_size=256, seq_len=32),
                           data=DataConfig(seed=0), mesh=MeshShape(),
                           train=TrainConfig(steps=10**6, global_batch=2, micro_batch=2, dtype="float32"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = S3Server(root)
        saved = set_env({**server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}"})
        store_tcp = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
        try:
            server.create_bucket("bench")
            init_process_group(rank=0, world_size=1, store=store_tcp, backend="gloo", timeout_s=300)
            trainer = Trainer(config, build_mesh(config.mesh, "cpu"), choose_device("float32"))
            trainer.train_step()  # optimizer state exists
            store = S3Store("bench", "goodput", part_size=PART, max_concurrency=CONCURRENCY)
            sink = ListSink()
            checkpointer = Checkpointer(store, run_id="bench", attempt=0, keep=2, sink=sink,
                                        staging_dir=root / "staging")
            raw_dir = root / "raw"
            dcp.save(trainer_state(trainer), checkpoint_id=str(raw_dir))
            files = sorted(p for p in raw_dir.iterdir() if p.is_file())
            total = sum(p.stat().st_size for p in files)
            client = boto3.client("s3")
            transfer = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                      max_concurrency=CONCURRENCY, use_threads=True)
            ours: list[float] = []
            theirs: list[float] = []
            for r in range(opts.rounds):
                trainer.step += 1
                t0 = time.perf_counter()
                checkpointer.save(trainer)
                checkpointer.wait()
                ours.append(total / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=len(files)) as pool:
                    list(pool.map(lambda p: client.upload_file(str(p), "bench", f"raw/{r}/{p.name}", Config=transfer),
                                  files))
                theirs.append(total / (time.perf_counter() - t0))
            checkpointer.close()
            failed = [d for k, d in sink.events if k == "checkpoint_failed"]
            assert not failed, failed
            found = latest_verified(store, "bench")
            assert found is not None and found[0].step == trainer.step, "the last save is committed and verifies"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            restore_env(saved)
            server.stop()
    o, t = statistics.median(ours), statistics.median(theirs)
    mib = 2**20
    print(f"checkpoint of {total / mib:.1f} MiB ({len(files)} files, {layers} layers of d_model {d_model}, AdamW); "
          f"part {PART >> 20} MiB, {CONCURRENCY} threads per file; moto S3 on loopback; n = {opts.rounds}, interleaved")
    print(f"goodput save (stage, write, hash, upload, commit): median {o / mib:.1f} MiB/s "
          f"(min {min(ours) / mib:.1f}, max {max(ours) / mib:.1f})")
    print(f"raw parallel upload of the same bytes:            median {t / mib:.1f} MiB/s "
          f"(min {min(theirs) / mib:.1f}, max {max(theirs) / mib:.1f})")
    print(f"ratio goodput / raw = {o / t:.3f}")
    figures = [records.figure("s3: goodput save (stage, write, hash, upload, commit)", [x / mib for x in ours],
                              "MiB/s"),
               records.figure("s3: raw parallel upload of the same bytes", [x / mib for x in theirs], "MiB/s"),
               records.figure("s3: goodput / raw (medians)", [o / t], "ratio")]
    records.write("s3_throughput", figures, code=["trainer/checkpoint.py", "checkpointing/store/s3.py",
                                                  "checkpointing/manifest.py"],
                  extra={"checkpoint_bytes": total, "files": len(files), "layers": layers, "part_bytes": PART,
                         "concurrency": CONCURRENCY})


if __name__ == "__main__":
    main()
