"""Rank side of the replica failure-domain tests: one process of one replica (its own world), its
shard position's cross-replica group in the test's store (the test plays the controller: it publishes
the membership epochs and kills a replica's processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.dist.parity import full
from trainer.config import config_from_dict


def replica_rank(*, rank: int, world_size: int, store_port: int, replica: int, incarnation: int, config: dict,
                 steps: int, epoch: int, timeout_s: float = 30.0, replicas: int = 2, keep_batch: bool = True,
                 corrupt_after: int | None = None) -> dict[str, Any]:
    """Train replica `replica` (its `incarnation`-th forming) from membership `epoch` to `steps`; its
    log, its state's checksum, its full parameters, the events it reported, and the silent data
    corruption it ended with, if any. `corrupt_after`: once its step reaches this, flip a mantissa
    bit of one element of its AdamW state (what no at-rest check of the parameters sees: only the
    replicas' comparison can)."""
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.probes import SilentDataCorruption
    from trainer.tensors import local_tensor
    from trainer.replica import CrossReplica, ReplicaBroken, checksum, state_tensors, train_replica
    from trainer.report import ListSink
    from trainer.train import Trainer

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    own = dist.PrefixStore(f"replica{replica}/i{incarnation}", store)
    init_process_group(rank=rank, world_size=world_size, store=own, backend="gloo", timeout_s=timeout_s)
    cfg = config_from_dict(config)
    mesh = build_mesh(cfg.mesh, "cpu")
    cross = CrossReplica(store, replica=replica, position=rank, device=choose_device(cfg.train.dtype).device,
                         timeout_s=timeout_s, replicas=replicas, keep_batch=keep_batch)
    sink = ListSink()
    trainer = Trainer(cfg, mesh, choose_device(cfg.train.dtype), replicas=cross, sink=sink)
    store.set(f"ready/{replica}/{incarnation}/{rank}", "1")
    source = trainer.switch(cross.board.get(epoch))
    log: list[dict[str, Any]] = [{"kind": "switched", "epoch": epoch, "step": trainer.step, "source": source}]

    def progress(report: Any) -> None:
        if rank == 0:
            store.set(f"progress/{replica}", str(report.step))
        if corrupt_after is not None and report.step == corrupt_after:
            exp_avg = local_tensor(trainer.optimizers[0].state[next(trainer.parts[0].parameters())]["exp_avg"])
            bits = exp_avg.view(-1).view(torch.int64)
            bits[0] ^= 1 << 40  # a mantissa bit: a relative change of ~1e-4, no anomaly to any probe

    removed, sdc = False, None
    try:
        log += train_replica(trainer, steps, wait_s=120.0, on_step=progress)
    except ReplicaBroken:
        removed = True
    except SilentDataCorruption as e:
        sdc = str(e)
    groups = [dist.get_world_size(g) for g in dist.distributed_c10d._world.pg_map]
    out = {"log": log, "removed": removed, "sdc": sdc, "events": sink.events, "step": trainer.step, "largest_world_group": max(groups),
           "largest_cross_group": cross.largest_group,
           "checksum": checksum(state_tensors(trainer.parts, trainer.optimizers)),
           "params": {name: full(p).detach().clone() for part in trainer.parts for name, p in part.named_parameters()}}
    cross.abort()
    dist.destroy_process_group()
    return out


def sync_member(*, rank: int, world_size: int, store_port: int, replicas: tuple[int, ...], joining: tuple[int, ...],
                values: dict[int, float], steps: dict[int, int], intact: dict[int, bool] | None = None) -> dict[str, Any]:
    """Replica `replicas[rank]` (a world of one: no process group of its own) takes membership epoch
    0 of `replicas` with `joining`, holding a state tensor full of `values[replica]` at step
    `steps[replica]`; what `CrossReplica.sync` made of it: {step, value, source} or {sdc, suspects, mine, value}."""
    from trainer.probes import SilentDataCorruption
    from trainer.replica import CrossReplica, Membership

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    replica = replicas[rank]
    cross = CrossReplica(store, replica=replica, position=0, device=torch.device("cpu"), timeout_s=30.0)
    cross.configure(Membership(0, replicas, joining=joining))
    state = torch.full((4,), values.get(replica, 0.0), dtype=torch.float64)
    try:
        step, _, source, _ = cross.sync(lambda: [state], steps.get(replica, 0), 0,
                                        intact=(intact or {}).get(replica, True))
    except SilentDataCorruption as e:
        return {"sdc": str(e), "suspects": getattr(e, "suspects", None), "mine": getattr(e, "mine", None),
                "value": float(state[0])}
    finally:
        cross.abort()
    return {"step": step, "value": float(state[0]), "source": source}
