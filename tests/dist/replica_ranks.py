"""Rank side of the replica failure-domain tests: one process of one replica (its own world), its
shard position's cross-replica group in the test's store (the test plays the controller: it publishes
the membership epochs and kills a replica's processes)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tests.dist.parity import full
from trainer.config import config_from_dict


def replica_rank(*, rank: int, world_size: int, store_port: int, replica: int, incarnation: int, config: dict,
                 steps: int, epoch: int, timeout_s: float = 30.0, replicas: int = 2, keep_batch: bool = True,
                 ) -> dict[str, Any]:
    """Train replica `replica` (its `incarnation`-th forming) from membership `epoch` to `steps`; its
    log, its state's checksum and its full parameters (None when the membership took it out)."""
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.replica import CrossReplica, ReplicaBroken, checksum, state_tensors, train_replica
    from trainer.train import Trainer

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    own = dist.PrefixStore(f"replica{replica}/i{incarnation}", store)
    init_process_group(rank=rank, world_size=world_size, store=own, backend="gloo", timeout_s=timeout_s)
    cfg = config_from_dict(config)
    mesh = build_mesh(cfg.mesh, "cpu")
    cross = CrossReplica(store, replica=replica, position=rank, device=choose_device(cfg.train.dtype).device,
                         timeout_s=timeout_s, replicas=replicas, keep_batch=keep_batch)
    trainer = Trainer(cfg, mesh, choose_device(cfg.train.dtype), replicas=cross)
    store.set(f"ready/{replica}/{incarnation}/{rank}", "1")
    source = trainer.switch(cross.board.get(epoch))
    log: list[dict[str, Any]] = [{"kind": "switched", "epoch": epoch, "step": trainer.step, "source": source}]

    def progress(report: Any) -> None:
        if rank == 0:
            store.set(f"progress/{replica}", str(report.step))

    removed = False
    try:
        log += train_replica(trainer, steps, wait_s=120.0, on_step=progress)
    except ReplicaBroken:
        removed = True
    groups = [dist.get_world_size(g) for g in dist.distributed_c10d._world.pg_map]
    out = {"log": log, "removed": removed, "step": trainer.step, "largest_world_group": max(groups),
           "largest_cross_group": cross.largest_group,
           "checksum": checksum(state_tensors(trainer.parts, trainer.optimizers)),
           "params": {name: full(p).detach().clone() for part in trainer.parts for name, p in part.named_parameters()}}
    cross.abort()
    dist.destroy_process_group()
    return out
