"""Bytes the object store sends back during a resume ÷ the size of the checkpoint step.

Starts moto's S3 server on 127.0.0.1 behind a proxy that counts the body bytes the server sends
back. The model is `make run`'s (examples/tiny-gpt.yaml); one attempt on its mesh, dp2 x pp2 x tp2
(8 gloo ranks, CPU), trains 2 steps and commits step 2 to s3://bench/goodput. Then, for each
resume below, with the counter at zero:
- the controller chooses the step to load (`resume_point`, as every launch does), and
- a new attempt's ranks load it (`run_worker` with `resume_step`, the real worker entry),
on the same mesh (a kill-node with a spare) and on dp1 x pp2 x tp2 (the shrink after `make run`'s
bitflip). The ratio is measured bytes ÷ the step's bytes by the manifest; the store's count is the
reference, independent of what the ranks report about themselves (shown beside it).

    python benchmarks/restore_traffic.py [--rounds 3]

At commit cb9ebec (before ranged reads) this printed 9.002 on dp2 x pp2 x tp2 and 5.002 on dp1 x pp2 x tp2: the
controller read the step once to verify it, and each of the 8 ranks downloaded all of it.

Its record: benchmarks/records/restore_traffic.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402
from tests.support.s3 import S3Server, restore_env, set_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
URI = "s3://bench/goodput"
CODE = ["checkpointing/manifest.py", "trainer/restore.py", "checkpointing/store/s3.py", "trainer/worker.py"]
"""What a resume's traffic measures: the step chosen, and what each rank reads of it."""


def attempt(*, rank: int, world_size: int, store_port: int, config: dict, attempt: int,
            resume_step: int | None) -> dict[str, Any]:
    """One rank of an attempt through the worker entry point: train to config's steps (saving at the
    last), or, with resume_step, load it and stop there."""
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    sink = ListSink()
    t0 = time.perf_counter()
    run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port,
                          store_prefix=f"attempt-{attempt}", config=cfg, run_id="bench", attempt=attempt,
                          checkpoint_uri=URI, checkpoint_every=cfg.train.steps if resume_step is None else 0,
                          resume_step=resume_step), sink)
    restored = [d for kind, d in sink.events if kind == "restored"]
    return {"seconds": time.perf_counter() - t0, "restored": restored[0] if restored else None}


def main() -> None:
    from checkpointing.manifest import read_manifest, resume_point
    from checkpointing.store import open_store
    from controller.spec import parse_spec
    from trainer.config import MeshShape, config_to_dict, state_fingerprint, state_identity

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="resumes per mesh (the bytes are the same each time)")
    opts = parser.parse_args()
    spec = parse_spec(yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()))
    train_steps = 2
    meshes = [MeshShape(dp=2, pp=2, tp=2), MeshShape(dp=1, pp=2, tp=2)]

    def config(mesh: MeshShape, steps: int) -> dict:
        c = config_to_dict(spec.trainer_config(mesh))
        c["train"]["steps"] = steps
        return c

    with tempfile.TemporaryDirectory() as tmp:
        server = S3Server(Path(tmp))
        saved = set_env(server.env())
        try:
            server.create_bucket("bench")
            run_ranks(attempt, meshes[0].world_size, config=config(meshes[0], train_steps), attempt=0, resume_step=None)
            store = open_store(URI)
            manifest = read_manifest(store, "bench", train_steps)
            model = spec.to_model_config()
            step_bytes = manifest.total_bytes()
            rows = []
            for mesh in meshes:
                for r in range(opts.rounds):
                    server.proxy.sent_bytes = 0
                    found = resume_point(store, "bench", identity=state_fingerprint(model),
                                         identity_detail=state_identity(model))
                    assert found is not None and found[0].step == train_steps
                    controller = server.proxy.sent_bytes
                    t0 = time.perf_counter()
                    ranks = run_ranks(attempt, mesh.world_size, config=config(mesh, train_steps), attempt=1 + r,
                                      resume_step=train_steps)
                    wall = time.perf_counter() - t0
                    total = server.proxy.sent_bytes
                    reported = ranks[0]["restored"]["bytes_read"] if "bytes_read" in ranks[0]["restored"] else None
                    rows.append((mesh, controller, total, reported, wall))
        finally:
            restore_env(saved)
            server.stop()

    mib = 2**20
    figures = [records.figure("resume: the step's bytes (by the manifest)", [step_bytes], "bytes")]
    print(f"step {train_steps} of make run's model: {step_bytes / mib:.2f} MiB in {len(manifest.files)} files "
          f"(saved on dp2 x pp2 x tp2); moto S3 on loopback behind a counting proxy; n = {opts.rounds} per mesh")
    for mesh in meshes:
        mine = [row for row in rows if row[0] == mesh]
        controller, total, reported = mine[0][1], mine[0][2], mine[0][3]
        assert all((row[1], row[2]) == (controller, total) for row in mine), "the bytes differ between rounds"
        walls = [row[4] for row in mine]
        print(f"resume onto dp{mesh.dp} x pp{mesh.pp} x tp{mesh.tp} "
              f"({mesh.world_size} ranks): store sent {total / mib:.2f} MiB "
              f"(controller {controller / mib:.3f} MiB, ranks {(total - controller) / mib:.2f} MiB"
              f"{'' if reported is None else f'; the ranks say {reported / mib:.2f} MiB'}); "
              f"attempt wall median {statistics.median(walls):.1f} s (min {min(walls):.1f}, max {max(walls):.1f})")
        print(f"  ratio store bytes / step bytes = {total / step_bytes:.3f}")
        onto = f"resume onto dp{mesh.dp} x pp{mesh.pp} x tp{mesh.tp}"
        figures += [records.figure(f"{onto}: store bytes / step bytes", [row[2] / step_bytes for row in mine], "ratio"),
                    records.figure(f"{onto}: store sent", [row[2] for row in mine], "bytes"),
                    records.figure(f"{onto}: store sent to the controller", [row[1] for row in mine], "bytes"),
                    records.figure(f"{onto}: store sent to the ranks", [row[2] - row[1] for row in mine], "bytes"),
                    records.figure(f"{onto}: attempt wall", walls, "s")]
        if reported is not None:
            figures.append(records.figure(f"{onto}: bytes the ranks say they read", [row[3] for row in mine if row[3] is not None], "bytes"))
    records.write("restore_traffic", figures, code=CODE, extra={"files": len(manifest.files), "rounds": opts.rounds})


if __name__ == "__main__":
    main()
