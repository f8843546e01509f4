"""Save and load a trainer's model and optimizer with torch.distributed.checkpoint (DCP).

Every rank writes its own shards; parameter and optimizer-state names are global FQNs, so a step
saved on one mesh loads onto another. The manifest (checkpointing.manifest) is written by rank 0
only after every rank finished writing: a save that dies midway leaves no manifest.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpointing.manifest import Manifest, commit

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(trainer) -> dict:  # type: ignore[no-untyped-def]
    model: dict = {}
    optim: dict = {}
    for part, opt in zip(trainer.parts, trainer.optimizers):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, opt, options=_FLAT))
    return {"model": model, "optim": optim}


def save(trainer, directory: Path, *, run_id: str) -> Manifest | None:  # type: ignore[no-untyped-def]
    """Collective: every rank writes its shards; rank 0 commits. Returns the manifest on rank 0."""
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(trainer), checkpoint_id=str(directory))
    dist.barrier()
    manifest = None
    if dist.get_rank() == 0:
        mesh = trainer.config.mesh
        manifest = commit(directory, Manifest(
            run_id=run_id, step=trainer.step, attempt=trainer.attempt,
            mesh={"dp": mesh.dp, "pp": mesh.pp, "tp": mesh.tp}, world_size=mesh.world_size,
            cursor=trainer.cursor,
            seeds={"data": trainer.config.data.seed, "init": trainer.config.train.seed},
        ))
    dist.barrier()
    return manifest


def load(trainer, directory: Path) -> None:  # type: ignore[no-untyped-def]
    """Collective: fill the trainer's model and optimizer from a committed step (any mesh)."""
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(directory))
    for part, opt in zip(trainer.parts, trainer.optimizers):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, opt, state["optim"], options=_FLAT)
