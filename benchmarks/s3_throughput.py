"""S3 checkpoint write throughput / a raw boto3 multipart upload of the same bytes to the same server.

Starts moto's S3 server on 127.0.0.1, writes a checkpoint-shaped set of files (4 x 32 MiB) through
goodput's S3Store.put_file and through boto3's own `upload_file` with the same part size and
concurrency, alternately, and prints the ratio of throughputs. Target: >= 0.8.

    python benchmarks/s3_throughput.py [--repeat 3] [--mib 32] [--files 4]
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

from checkpointing.store import S3Store  # noqa: E402
from tests.support.s3 import S3Server, restore_env, set_env  # noqa: E402

PART = 16 * 2**20
CONCURRENCY = 8


def main() -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--files", type=int, default=4)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = S3Server(Path(tmp))
        saved = set_env({**server.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}"})
        try:
            server.create_bucket("bench")
            files = []
            for i in range(opts.files):
                path = Path(tmp) / f"__{i}_0.distcp"
                path.write_bytes(os.urandom(opts.mib * 2**20))
                files.append(path)
            total = opts.files * opts.mib * 2**20
            store = S3Store("bench", "goodput", part_size=PART, max_concurrency=CONCURRENCY)
            raw = boto3.client("s3")
            config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                    max_concurrency=CONCURRENCY, use_threads=True)
            ours, theirs = [], []
            for r in range(opts.repeat):
                t0 = time.perf_counter()
                for path in files:
                    store.put_file(f"step-{r}/{path.name}", path)
                t1 = time.perf_counter()
                for path in files:
                    raw.upload_file(str(path), "bench", f"raw/step-{r}/{path.name}", Config=config)
                t2 = time.perf_counter()
                ours.append(total / (t1 - t0))
                theirs.append(total / (t2 - t1))
        finally:
            restore_env(saved)
            server.stop()
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"{opts.files} x {opts.mib} MiB, part {PART >> 20} MiB, {CONCURRENCY} threads, moto server on loopback")
    print(f"goodput S3Store: median {o / 2**20:.1f} MiB/s (min {min(ours) / 2**20:.1f}, max {max(ours) / 2**20:.1f})")
    print(f"raw boto3 upload_file: median {t / 2**20:.1f} MiB/s (min {min(theirs) / 2**20:.1f}, "
          f"max {max(theirs) / 2**20:.1f})")
    print(f"ratio goodput / raw = {o / t:.3f} (target >= 0.8)")


if __name__ == "__main__":
    main()
