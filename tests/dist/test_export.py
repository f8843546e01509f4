"""`goodput export` from a checkpoint a 3-D mesh wrote: transformers' LlamaForCausalLM loads the folder
and computes the loss the trainer's own model gives on the same tokens (1e-4 relative), and every
exported tensor equals the trainer's full parameter at that step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from checkpointing.store import open_store
from tests.dist.harness import run_ranks
from tests.dist.reshard import save_on_mesh
from trainer.config import DataConfig, MeshShape, TrainConfig, TrainerConfig, config_to_dict, model_from_dict
from trainer.presets import preset_fields

pytestmark = pytest.mark.dist


def test_a_checkpoint_saved_on_a_3d_mesh_exports_to_what_transformers_loads(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from trainer.export import export_hf
    from trainer.model import Transformer, cross_entropy

    model = model_from_dict({**preset_fields("llama3-tiny"), "n_layers": 4, "vocab_size": 96, "seq_len": 16})
    cfg = TrainerConfig(model=model, data=DataConfig(seed=2),
                        train=TrainConfig(steps=3, global_batch=8, micro_batch=1, lr=1e-2, dtype="float32"),
                        mesh=MeshShape(dp=2, pp=2, tp=2))
    uri = f"file://{tmp_path / 'ckpt'}"
    states = run_ranks(save_on_mesh, 8, config=config_to_dict(cfg), uri=uri)
    trained = {k.removeprefix("model."): v for s in states for k, v in s.items() if k.startswith("model.")}
    step = export_hf(open_store(uri), "reshard", model, tmp_path / "hf", dtype="float32")
    assert step == 3
    ours = Transformer(model)
    ours.load_state_dict(trained)
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, model.vocab_size, (4, model.seq_len + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        our_loss = float(cross_entropy(ours(tokens[:, :-1]), tokens[:, 1:]))
        logits = theirs(input_ids=tokens[:, :-1]).logits
        their_loss = float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
    assert abs(our_loss - their_loss) <= 1e-4 * their_loss, (our_loss, their_loss)
    from trainer.hf import load_hf

    _, exported = load_hf(tmp_path / "hf", seq_len=model.seq_len)
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[n], trained[n]) for n in trained)
    # ... and a new run starts from that folder on another mesh (model.init.hf): the same parameters.
    start = TrainerConfig(model=model, data=cfg.data, mesh=MeshShape(dp=1, pp=2, tp=2),
                          train=TrainConfig(steps=1, global_batch=8, micro_batch=2, dtype="float32",
                                            init_hf=str(tmp_path / "hf")))
    started = run_ranks(init_from_hf, 4, config=config_to_dict(start))
    loaded = {k: v for s in started for k, v in s.items()}
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)


def init_from_hf(*, rank: int, world_size: int, store_port: int, config: dict) -> dict:
    """The full parameters a fresh trainer has after taking its weights from config.train.init_hf."""
    import torch.distributed as dist

    from tests.dist.parity import full
    from trainer.config import config_from_dict
    from trainer.hf import load_into
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.train import Trainer

    cfg = config_from_dict(config)
    store = dist.PrefixStore("init", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=120)
    try:
        trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
        assert cfg.train.init_hf is not None
        load_into(trainer, Path(cfg.train.init_hf))
        params = {n: full(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()}
        return params if trainer.mesh["tp"].get_local_rank() == 0 else {}
    finally:
        dist.destroy_process_group()
