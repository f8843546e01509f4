"""Rank-side helpers of the parity tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.config import TrainerConfig, config_from_dict
from trainer.data import build_source
from trainer.provider import load_provider


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def one_step_grads(*, rank: int, world_size: int, store_port: int, configs: list[dict]) -> list[dict[str, Any]]:
    """Loss and full gradients after one forward/backward of the trainer, for each config in turn
    (several schedules share one process group: process start-up dominates these tests)."""
    from trainer.optim import global_grad_norm
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
            norm = global_grad_norm(trainer.parts, cfg.mesh.dp * cfg.mesh.tp, trainer.choice.device)
            grads = {}
            for part in trainer.parts:
                for name, p in part.named_parameters():
                    assert p.grad is not None, f"{name} has no gradient after the backward"
                    grads[name] = full(p.grad).detach().clone()
            keep = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
            out.append({"loss": loss, "grads": grads if keep else {}, "grad_norm": norm})
    finally:
        dist.destroy_process_group()
    return out


def whole_model(cfg: TrainerConfig) -> tuple[Any, torch.nn.Module]:
    """The model's provider and its whole model in float64 on one process, initialised as training does."""
    provider = load_provider(cfg.model)
    model = provider.build_stage(range(cfg.model.layers), first=True, last=True).double()
    provider.init_weights(model, cfg.train.seed)
    return provider, model


def reference_grads(cfg: TrainerConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Single process, float64, the whole global batch at once, the whole model in plain torch (its
    provider's one stage of every layer: goodput's decoder or a user's): the independent reference."""
    provider, model = whole_model(cfg)
    rows = torch.from_numpy(build_source(cfg.data, cfg.model).batch(range(cfg.train.global_batch)))
    loss = provider.loss(model(rows[:, :-1]), rows[:, 1:])
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient after the backward"
        grads[name] = p.grad.detach().clone()
    return float(loss.detach()), grads


def train_steps(*, rank: int, world_size: int, store_port: int, config: dict) -> dict[str, torch.Tensor]:
    """The full parameters after the config's train.steps steps of the trainer (every rank returns them)."""
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.train import Trainer

    store = dist.PrefixStore("steps", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=120)
    try:
        cfg = config_from_dict(config)
        trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device(cfg.train.dtype))
        for _ in range(cfg.train.steps):
            trainer.train_step()
        return {name: full(p).detach().clone() for part in trainer.parts for name, p in part.named_parameters()}
    finally:
        dist.destroy_process_group()


def reference_training(cfg: TrainerConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single process, float64, the whole global batch per step, torch's own AdamW and
    clip_grad_norm_, the learning rate set by hand from the schedule: the parameters after
    train.steps steps, and the gradient norm of each step (before clipping)."""
    t = cfg.train
    provider, model = whole_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    source = build_source(cfg.data, cfg.model)
    norms = []
    for step in range(1, t.steps + 1):
        rows = torch.from_numpy(source.batch(range((step - 1) * t.global_batch, step * t.global_batch)))
        provider.loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))))
        for group in opt.param_groups:
            group["lr"] = t.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms
