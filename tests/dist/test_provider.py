"""A model of the user's own, through trainer/provider.py's contract: examples/gpt2_provider.py (a
GPT-2-shaped decoder: learned positions, LayerNorm with biases, GELU, biased projections) on
dp2 x pp2 x tp2 keeps what goodput gives its own decoder. Against independent references: four steps
equal the same model trained by torch's AdamW on one float64 process; a run interrupted at a
checkpoint and resumed ends bit-identical to an uninterrupted one, and the checkpoint loads onto one
process bit-identical; a flipped bit is caught before its update and the rank named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.parity import reference_training, train_steps
from tests.dist.reshard import load_on_mesh, save_on_mesh
from tests.dist.test_checkpoint_resume import two_runs
from trainer.config import DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig, config_to_dict
from trainer.provider import ask_numbers

pytestmark = pytest.mark.dist

TOL = 1e-9
PROVIDER = "examples.gpt2_provider:build"


def gpt2(**args: int) -> ModelConfig:
    """The example's model, its numbers asked of it as the controller asks them before planning."""
    model = ModelConfig(n_layers=0, d_model=0, n_heads=0, vocab_size=64, seq_len=16, provider=PROVIDER,
                        provider_args=tuple(sorted({"n_layers": 4, "d_model": 32, "n_heads": 4, **args}.items())))
    return dataclasses.replace(model, numbers=ask_numbers(model))


def config(mesh: MeshShape, **train: object) -> TrainerConfig:
    return TrainerConfig(model=gpt2(), data=DataConfig(seed=5), mesh=mesh,
                         train=TrainConfig(**{"steps": 4, "global_batch": 8, "micro_batch": 1, "lr": 1e-2,
                                              "dtype": "float32", "seed": 3, **train}))  # type: ignore[arg-type]


def test_four_steps_on_a_3d_mesh_equal_torch_on_one_float64_process() -> None:
    """Warmup, cosine decay, clipping below every step's norm and every layer recomputing: the user's
    model gets goodput's whole loop, and ends where plain torch does."""
    cfg = config(MeshShape(dp=2, pp=2, tp=2), dtype="float64", weight_decay=0.1, warmup_steps=2, decay="cosine",
                 min_lr_ratio=0.1, grad_clip=0.05, activation_checkpointing="full")
    ref_params, norms = reference_training(cfg)
    assert min(norms) > 0.05, f"every step clips: {norms}"
    assert any(name.endswith("attn.q.bias") for name in ref_params), "GPT-2's own parameters are part of the check"
    per_rank = run_ranks(train_steps, 8, config=config_to_dict(cfg))
    assert set().union(*per_rank) == set(ref_params)
    for params in per_rank:
        for name, value in params.items():
            err = (value - ref_params[name]).abs().max().item()
            assert err < TOL, f"{name} differs by {err}"


def test_a_resume_is_bit_identical_and_the_checkpoint_reshards_to_one_process(tmp_path: Path) -> None:
    cfg = config(MeshShape(dp=2, pp=2, tp=2))
    results = run_ranks(two_runs, 8, config=config_to_dict(cfg), root=str(tmp_path / "resume"))
    for r in results:
        assert r["straight"] and set(r["straight"]) == set(r["resumed"])
        for name, value in r["straight"].items():
            assert torch.equal(value, r["resumed"][name]), f"{name} differs after resume"
    uri = f"file://{tmp_path / 'reshard'}"
    saved: dict[str, torch.Tensor] = {}
    for state in run_ranks(save_on_mesh, 8, config=config_to_dict(config(MeshShape(dp=2, pp=2, tp=2), steps=2)),
                           uri=uri):
        saved.update(state)
    (one,) = run_ranks(load_on_mesh, 1, config=config_to_dict(config(MeshShape(), steps=2)), uri=uri, step=2)
    assert set(one["state"]) == set(saved) and any(k.endswith("exp_avg_sq") for k in saved)
    for key, value in saved.items():
        assert torch.equal(one["state"][key], value), f"{key} differs on one process"


def flip_rank(*, rank: int, world_size: int, store_port: int, config: dict, flip: int) -> dict:
    import torch.distributed as dist

    from trainer.config import config_from_dict
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.probes import SilentDataCorruption
    from trainer.report import ListSink
    from trainer.switches import DrillSwitches
    from trainer.train import Trainer

    c = config_from_dict(config)
    choice = choose_device(c.train.dtype)
    store = dist.PrefixStore("flip", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend=choice.backend, timeout_s=60)
    sink, switches = ListSink(), DrillSwitches()
    trainer = Trainer(c, build_mesh(c.mesh, choice.device.type), choice, sink=sink, switches=switches)
    for _ in range(3):
        trainer.train_step()
    if rank == flip:
        switches.request_bitflip()
    error = None
    try:
        trainer.train_step()
    except SilentDataCorruption as e:
        error = str(e)
    dist.destroy_process_group()
    return {"error": error, "step": trainer.step, "events": sink.events}


def test_a_flipped_bit_is_caught_before_its_update_and_the_rank_named() -> None:
    cfg = dataclasses.replace(config(MeshShape(dp=2, pp=2, tp=2), steps=10),
                              probes=ProbeConfig(enabled=True, sdc_every_steps=3))
    results = run_ranks(flip_rank, 8, config=config_to_dict(cfg), flip=6)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "ranks [6]" in r["error"], r["error"]
        assert r["step"] == 3, "the corrupted step was not applied"
        flags = [k for k, _ in r["events"] if k in ("sdc_suspect", "sdc_transient", "loss_anomaly")]
        assert flags == (["sdc_suspect"] if rank == 0 else []), "one verdict, from rank 0"
    assert dict(results[0]["events"])["sdc_suspect"]["ranks"] == [6]
