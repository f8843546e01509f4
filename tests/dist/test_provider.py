"""Your model, your data, and every guarantee kept, on dp2 x pp2 x tp2, for two models: a model of the
user's own through trainer/provider.py's contract (examples/gpt2_provider.py, a GPT-2-shaped decoder:
learned positions, LayerNorm with biases, GELU, biased projections), and goodput's Llama 3 shape with
grouped-query attention and scaled RoPE on tokenized text (a dataset `goodput tokenize` wrote).
Against independent references: four steps equal the same model trained by torch's AdamW on one
float64 process, and so do two steps on dp2 then two resumed on dp1 (a shrink keeps the global batch
and the data position); a run interrupted at a checkpoint and resumed ends bit-identical to an
uninterrupted one, and the checkpoint loads onto one process bit-identical; a flipped bit is caught
before its update and the rank named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.parity import reference_training, train_steps
from tests.dist.reshard import load_on_mesh, save_on_mesh
from tests.dist.test_checkpoint_resume import two_runs
from tests.dist.test_parity import assert_same_params
from trainer.config import DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig, config_to_dict
from trainer.provider import ask_numbers

pytestmark = pytest.mark.dist

TOL = 1e-9

PROVIDER = "examples.gpt2_provider:build"


def gpt2() -> ModelConfig:
    """The example's model, its numbers asked of it as the controller asks them before planning."""
    model = ModelConfig(n_layers=0, d_model=0, n_heads=0, vocab_size=64, seq_len=16, provider=PROVIDER,
                        provider_args=(("d_model", 32), ("n_heads", 4), ("n_layers", 4)))
    return dataclasses.replace(model, numbers=ask_numbers(model))


def tokenized_text(root: Path) -> str:
    """A small corpus tokenized as a user would (`goodput tokenize`, a BPE tokenizer of 300 tokens)."""
    import random

    from tests.support.text import train_tokenizer

    from trainer.tokenize import tokenize

    rng = random.Random(0)
    words = ("node", "rank", "step", "loss", "shard", "peer", "drill", "spare", "mesh", "token", "heal", "store")
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "." for _ in range(120)]
    (root / "corpus.txt").write_text("\n".join(docs))
    train_tokenizer(docs, root / "tokenizer.json")
    uri = f"file://{root / 'data'}"
    tokenize([root / "corpus.txt"], root / "tokenizer.json", uri)
    return uri


@pytest.fixture(scope="module", params=["gpt2-provider", "llama3-gqa-on-text"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, DataConfig]:
    if request.param == "gpt2-provider":
        return gpt2(), DataConfig(seed=5)
    from trainer.config import model_from_dict
    from trainer.presets import preset_fields

    uri = tokenized_text(tmp_path_factory.mktemp("text"))
    model = model_from_dict({**preset_fields("llama3-tiny"), "n_layers": 4, "seq_len": 16})
    return model, DataConfig(kind="shards", seed=5, datasets=((uri, 1.0),))


def config(case: tuple[ModelConfig, DataConfig], mesh: MeshShape, **train: object) -> TrainerConfig:
    model, data = case
    return TrainerConfig(model=model, data=data, mesh=mesh,
                         train=TrainConfig(**{"steps": 4, "global_batch": 8, "micro_batch": 1, "lr": 1e-2,
                                              "dtype": "float32", "seed": 3, **train}))  # type: ignore[arg-type]


def test_four_steps_on_a_3d_mesh_equal_torch_on_one_float64_process(case: tuple[ModelConfig, DataConfig]) -> None:
    """Warmup, cosine decay, clipping below every step's norm and every layer recomputing: the model
    gets goodput's whole loop, and ends where plain torch does."""
    cfg = config(case, MeshShape(dp=2, pp=2, tp=2), dtype="float64", weight_decay=0.1, warmup_steps=2,
                 decay="cosine", min_lr_ratio=0.1, grad_clip=0.05, activation_checkpointing="full")
    ref_params, norms = reference_training(cfg)
    assert min(norms) > 0.05, f"every step clips: {norms}"
    assert_same_params(run_ranks(train_steps, 8, config=config_to_dict(cfg)), ref_params, TOL)


def test_a_resume_is_bit_identical_and_the_checkpoint_reshards_to_one_process(
        case: tuple[ModelConfig, DataConfig], tmp_path: Path) -> None:
    cfg = config(case, MeshShape(dp=2, pp=2, tp=2))
    results = run_ranks(two_runs, 8, config=config_to_dict(cfg), root=str(tmp_path / "resume"))
    for r in results:
        assert r["straight"] and set(r["straight"]) == set(r["resumed"])
        for name, value in r["straight"].items():
            assert torch.equal(value, r["resumed"][name]), f"{name} differs after resume"
    uri = f"file://{tmp_path / 'reshard'}"
    saved: dict[str, torch.Tensor] = {}
    for state in run_ranks(save_on_mesh, 8, uri=uri,
                           config=config_to_dict(config(case, MeshShape(dp=2, pp=2, tp=2), steps=2))):
        saved.update(state)
    (one,) = run_ranks(load_on_mesh, 1, config=config_to_dict(config(case, MeshShape(), steps=2)), uri=uri,
                          step=2)
    assert set(one["state"]) == set(saved) and any(k.endswith("exp_avg_sq") for k in saved)
    for key, value in saved.items():
        assert torch.equal(one["state"][key], value), f"{key} differs on one process"


def run_phase(*, rank: int, world_size: int, store_port: int, config: dict, root: str,
              resume_step: int | None) -> dict:
    """Train to config's train.steps through the worker entry point (checkpoints every 2 steps),
    resuming from `resume_step`'s checkpoint if given; the full parameters at the end."""
    from tests.dist.parity import full
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    out: dict = {}

    def grab(trainer, report) -> None:  # type: ignore[no-untyped-def]
        if trainer.step == trainer.config.train.steps:
            out.update({n: full(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()})

    run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port,
                          store_prefix=f"phase-{resume_step}", config=config_from_dict(config), run_id="shrunk",
                          attempt=0 if resume_step is None else 1, resume_step=resume_step, checkpoint_every=2,
                          checkpoint_uri=f"file://{root}", staging_dir=f"{root}/staging"),
               ListSink(), grab)
    return out


def test_a_shrink_keeps_the_global_batch_and_the_data_position(case: tuple[ModelConfig, DataConfig],
                                                               tmp_path: Path) -> None:
    """Two steps on dp2 x pp2 x tp2, then the checkpoint resumed on dp1 x pp2 x tp2 (a replica lost):
    the same samples per step, so the four steps equal one float64 process's (1e-9)."""
    full = config(case, MeshShape(dp=2, pp=2, tp=2), dtype="float64", micro_batch=2)
    ref_params, _ = reference_training(full)
    first = dataclasses.replace(full, train=dataclasses.replace(full.train, steps=2))
    run_ranks(run_phase, 8, config=config_to_dict(first), root=str(tmp_path), resume_step=None)
    shrunk = dataclasses.replace(full, mesh=MeshShape(dp=1, pp=2, tp=2))
    assert_same_params(run_ranks(run_phase, 4, config=config_to_dict(shrunk), root=str(tmp_path), resume_step=2),
                       ref_params, TOL)


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


def test_a_flipped_bit_is_caught_before_its_update_and_the_rank_named(case: tuple[ModelConfig, DataConfig]) -> None:
    cfg = dataclasses.replace(config(case, MeshShape(dp=2, pp=2, tp=2), steps=10),
                              probes=ProbeConfig(enabled=True, sdc_every_steps=3))
    results = run_ranks(flip_rank, 8, config=config_to_dict(cfg), flip=6)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "ranks [6]" in r["error"], r["error"]
        assert r["step"] == 3, "the corrupted step was not applied"
        flags = [k for k, _ in r["events"] if k in ("sdc_suspect", "sdc_transient", "loss_anomaly")]
        assert flags == (["sdc_suspect"] if rank == 0 else []), "one verdict, from rank 0"
    assert dict(results[0]["events"])["sdc_suspect"]["ranks"] == [6]
