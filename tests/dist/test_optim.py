"""The trainer's AdamW (trainer/optim.py: the update on each parameter's local shard) against torch's own
AdamW on the same DTensors, on 2 gloo ranks: shards on either dim, a replicated parameter, weight
decay and a learning rate that changes every step; then a step with a Partial gradient (not what a
backward leaves here, but one the update must not read as a shard: torch's path reduces it first).
Same bits in the parameters and in the state after every step, and the state is still DTensors
placed like their parameters (what DCP reshards)."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def both_optimizers(*, rank: int, world_size: int, store_port: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from trainer.optim import ShardLocalAdamW

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    placements = [[Shard(0)], [Shard(1)], [Replicate()]]
    shapes = [(8, 6), (4, 10), (6,)]

    def params(seed: int) -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, p))
                for s, p in zip(shapes, placements)]

    ours, theirs = params(0), params(0)
    mine = ShardLocalAdamW(ours, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    same = []
    for step in range(1, 7):
        for a, b in zip(ours, theirs):
            grad = distribute_tensor(torch.randn(a.shape, generator=g), mesh, a.placements)
            a.grad, b.grad = grad, grad.clone()
        for opt in (mine, reference):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * step / 6  # (a scalar that differs every step)
            opt.step()
        state_same = all(torch.equal(mine.state[a][k].to_local(), reference.state[b][k].to_local())
                         for a, b in zip(ours, theirs) for k in ("exp_avg", "exp_avg_sq"))
        same.append(state_same and all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours, theirs)))
    for a, b in zip(ours[:2], theirs[:2]):
        a.grad = b.grad = None
    local = torch.full(ours[2].to_local().shape, float(rank + 1))  # rank r's addend: the gradient is their sum
    ours[2].grad = DTensor.from_local(local, mesh, [Partial()], run_check=False)
    theirs[2].grad = DTensor.from_local(local.clone(), mesh, [Partial()], run_check=False)
    mine.step()
    reference.step()
    partial_same = torch.equal(ours[2].to_local(), theirs[2].to_local())
    kept = all(isinstance(mine.state[p][k], DTensor) and mine.state[p][k].placements == p.placements
               for p in ours for k in ("exp_avg", "exp_avg_sq"))
    moved = not torch.equal(ours[0].to_local(), params(0)[0].to_local())
    dist.destroy_process_group()
    return {"same": same, "kept": kept, "moved": moved, "partial_same": partial_same}


def test_the_update_on_local_shards_equals_torchs_adamw_on_dtensors_bit_for_bit() -> None:
    for r in run_ranks(both_optimizers, 2):
        assert r["moved"], "the parameters were updated"
        assert r["same"] == [True] * 6, r["same"]
        assert r["kept"], "the state stays DTensors placed like their parameters"
        assert r["partial_same"], "a Partial gradient was read as this rank's shard"
