"""Rank-side helpers of the parity tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.config import TrainerConfig, config_from_dict
from trainer.model import Transformer, cross_entropy
from trainer.data import build_source


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def one_step_grads(*, rank: int, world_size: int, store_port: int, configs: list[dict]) -> list[dict[str, Any]]:
    """Loss and full gradients after one forward/backward of the trainer, for each config in turn
    (several schedules share one process group: process start-up dominates these tests)."""
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.train import Trainer

    store = dist.PrefixStore("parity", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=120)
    out = []
    try:
        for raw in configs:
            cfg = config_from_dict(raw)
            mesh = build_mesh(cfg.mesh, "cpu")
            trainer = Trainer(cfg, mesh, choose_device(cfg.train.dtype))
            inputs, targets = trainer.local_batch()
            loss = trainer._global_loss(trainer.forward_backward(inputs, targets))
            grads = {}
            for part in trainer.parts:
                for name, p in part.named_parameters():
                    grads[name] = full(p.grad).detach().clone()
            keep = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
            out.append({"loss": loss, "grads": grads if keep else {}})
    finally:
        dist.destroy_process_group()
    return out


def reference_grads(cfg: TrainerConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Single process, float64, the whole global batch at once: the independent reference."""
    model = Transformer(cfg.model).double()
    model.init_weights(cfg.train.seed)
    rows = torch.from_numpy(build_source(cfg.data, cfg.model).batch(range(cfg.train.global_batch)))
    loss = cross_entropy(model(rows[:, :-1]), rows[:, 1:])
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
