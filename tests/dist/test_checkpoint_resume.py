"""Through the real worker entry point: a run interrupted at a checkpoint and resumed on the same mesh
ends bit-identical to an uninterrupted run (CPU, fp32), and the checkpoint is committed by a
manifest whose checksums match the files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpointing.manifest import committed_steps, read_manifest, verify
from checkpointing.store import LocalStore
from tests.dist.harness import run_ranks
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_to_dict

pytestmark = pytest.mark.dist


def _params_at_end(trainer, report) -> dict:  # type: ignore[no-untyped-def]
    from tests.dist.parity import full

    if trainer.step != trainer.config.train.steps:
        return {}
    return {n: full(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()}


def two_runs(*, rank: int, world_size: int, store_port: int, config: dict, root: str) -> dict:
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    out: dict = {}

    def grab(key: str):  # type: ignore[no-untyped-def]
        def hook(trainer, report) -> None:  # type: ignore[no-untyped-def]
            params = _params_at_end(trainer, report)
            if params:
                out[key] = params
        return hook

    common = dict(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port,
                  config=cfg, checkpoint_every=2, checkpoint_keep=5, checkpoint_uri=f"file://{root}",
                  staging_dir=f"{root}/staging")
    # Uninterrupted: 4 steps, checkpoints at 2 and 4.
    run_worker(WorkerArgs(store_prefix="a", run_id="straight", **common),  # type: ignore[arg-type]
               ListSink(), grab("straight"))
    # Interrupted after step 2 (its own checkpoints), resumed from step 2 as a new attempt.
    short = TrainerConfig(model=cfg.model, data=cfg.data, mesh=cfg.mesh,
                          train=TrainConfig(**{**cfg.train.__dict__, "steps": 2}))
    run_worker(WorkerArgs(**{**common, "config": short}, store_prefix="b", run_id="resumed"),  # type: ignore[arg-type]
               ListSink())
    sink = ListSink()
    run_worker(WorkerArgs(**common, store_prefix="c", run_id="resumed", attempt=1, resume_step=2),  # type: ignore[arg-type]
               sink, grab("resumed"))
    out["events"] = sink.events
    return out


def test_resume_same_mesh_is_bit_identical(tmp_path: Path) -> None:
    cfg = TrainerConfig(
        model=ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        data=DataConfig(seed=4),
        train=TrainConfig(steps=4, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32"),
        mesh=MeshShape(dp=2, pp=2, tp=1),
    )
    results = run_ranks(two_runs, 4, config=config_to_dict(cfg), root=str(tmp_path))
    for r in results:
        assert set(r["straight"]) == set(r["resumed"])
        for name, value in r["straight"].items():
            assert torch.equal(value, r["resumed"][name]), f"{name} differs after resume"
        (restored,) = [d for kind, d in r["events"] if kind == "restored"]
        # Each byte of the step came from the store once: the replicated items (the optimizer's scalars
        # over dp) were read by one rank and sent to the others.
        assert restored["bytes_read"] == restored["bytes"] == read_manifest(LocalStore(tmp_path), "resumed", 2).total_bytes()
        assert {k: restored[k] for k in ("step", "cursor", "saved_on_mesh")} == {
            "step": 2, "cursor": 16, "saved_on_mesh": {"dp": 2, "pp": 2, "tp": 1}}
    store = LocalStore(tmp_path)
    assert committed_steps(store, "straight") == [2, 4]
    for step in committed_steps(store, "straight"):
        manifest = read_manifest(store, "straight", step)
        verify(store, manifest)
        assert manifest.step == step and manifest.cursor == step * 8 and manifest.world_size == 4
        assert sorted(manifest.files) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
