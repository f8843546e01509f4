"""Training really learns: on the synthetic Markov source the held-out loss reaches within 0.1 nat of
the chain's exact entropy rate (single process, small model)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig
from trainer.data import uniform_entropy
from trainer.model import cross_entropy
from trainer.parallel import build_mesh, choose_device


def test_reaches_entropy_rate_of_synthetic_source() -> None:
    cfg = TrainerConfig(
        model=ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=16, seq_len=32),
        data=DataConfig(seed=2, branching=3),
        train=TrainConfig(steps=150, global_batch=32, micro_batch=16, lr=1e-2, dtype="float32"),
        mesh=MeshShape(),
    )
    from trainer.train import Trainer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
        floor = trainer.source.chain.entropy_rate()  # type: ignore[attr-defined]
        assert floor < uniform_entropy(16) - 1.0, "the source must be far from uniform to prove learning"
        while trainer.step < cfg.train.steps:
            trainer.train_step()
        held_out = torch.from_numpy(trainer.source.batch(range(10**6, 10**6 + 256)))
        with torch.no_grad():
            loss = float(cross_entropy(trainer.parts[0](held_out[:, :-1]), held_out[:, 1:]))
    finally:
        dist.destroy_process_group()
    assert loss < floor + 0.1, f"held-out loss {loss:.4f} vs entropy rate {floor:.4f}"
    assert loss > floor - 0.05, f"held-out loss {loss:.4f} below the entropy rate {floor:.4f}: impossible"
