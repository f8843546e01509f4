"""Rank-side helpers of the resharding tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests.dist.parity import full


def full_state(trainer: Any) -> dict[str, torch.Tensor]:
    """Model and optimizer state reassembled to full tensors (collective), keyed by global names."""
    out: dict[str, torch.Tensor] = {}
    for part, opt in zip(trainer.parts, trainer.optimizers):
        for name, p in part.named_parameters():
            out[f"model.{name}"] = full(p).detach().clone()
        flat = get_optimizer_state_dict(part, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        for key in sorted(flat):
            value = flat[key]
            if isinstance(value, torch.Tensor):
                out[f"optim.{key}"] = full(value).detach().clone()
    return out


def save_on_mesh(*, rank: int, world_size: int, store_port: int, config: dict, uri: str) -> dict:
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    captured: dict = {}

    def hook(trainer: Any, report: Any) -> None:
        if trainer.step == cfg.train.steps:
            captured["state"] = full_state(trainer)
            captured["keep"] = trainer.mesh["dp"].get_local_rank() == 0 and trainer.mesh["tp"].get_local_rank() == 0

    run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port,
                          store_prefix="save", config=cfg, run_id="reshard", checkpoint_uri=uri,
                          checkpoint_every=cfg.train.steps), ListSink(), hook)
    return captured["state"] if captured["keep"] else {}


def load_on_mesh(*, rank: int, world_size: int, store_port: int, config: dict, uri: str, step: int,
                 run_id: str = "reshard") -> dict:
    from checkpointing.manifest import read_manifest
    from checkpointing.store import open_store
    from trainer.restore import load
    from trainer.config import config_from_dict
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.train import Trainer

    cfg = config_from_dict(config)
    store = dist.PrefixStore("load", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=120)
    try:
        mesh = build_mesh(cfg.mesh, "cpu")
        trainer = Trainer(cfg, mesh, choose_device(cfg.train.dtype))
        ckpt = open_store(uri)
        manifest = read_manifest(ckpt, run_id, step)
        read = load(trainer, ckpt, manifest)
        state = full_state(trainer)
        keep = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
        return {"state": state if keep else {}, "cursor": manifest.cursor, "bytes_read": read,
                "bytes": manifest.total_bytes()}
    finally:
        dist.destroy_process_group()
