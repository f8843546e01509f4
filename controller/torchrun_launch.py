"""Run a spec with torch's own launcher (torchrun) on this machine: one process per rank.

No fault tolerance here: this is the plain path a user of torchrun already knows, kept so that the
worker entry point is proven launcher-agnostic. `goodput run` uses the Ray controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

from trainer.config import TrainerConfig, config_to_dict
from trainer.report import StepReport


def run_with_torchrun(config: TrainerConfig, on_report: Callable[[StepReport], None]) -> int:
    """Start torchrun with world_size local processes and stream their reports; returns its exit code."""
    world = config.mesh.world_size
    with tempfile.TemporaryDirectory(prefix="goodput-torchrun-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config_to_dict(config), f)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "trainer.worker", "--config", cfg_path, "--report-dir", tmp]
        log_path = os.path.join(tmp, "torchrun.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        offsets: dict[str, int] = {}
        try:
            while True:
                done = proc.poll() is not None
                for name in sorted(os.listdir(tmp)):
                    if name.endswith(".jsonl"):
                        _read_new_lines(os.path.join(tmp, name), offsets, on_report)
                if done:
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(30)
            raise
        if proc.returncode != 0:
            with open(log_path) as log:
                sys.stderr.write(log.read()[-4000:])
        return proc.returncode


def _read_new_lines(path: str, offsets: dict[str, int], on_report: Callable[[StepReport], None]) -> None:
    """Feed complete JSON lines appended since the last call (a half-written line waits)."""
    with open(path, "rb") as f:
        f.seek(offsets.get(path, 0))
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    offsets[path] = offsets.get(path, 0) + len(complete)
    for line in complete.decode().splitlines():
        if '"event"' not in line[:10]:
            on_report(StepReport.from_json(line))
