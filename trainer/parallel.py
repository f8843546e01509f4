"""Device, mesh and the three kinds of parallelism, all from torch's own building blocks.

- TP: `torch.distributed.tensor.parallel` (column-wise q/k/v and w1/w3, row-wise wo and w2);
- PP: the model cut into stages for `torch.distributed.pipelining`;
- DP: FSDP2 `fully_shard` over `dp` (HSDP over a 2-D dp mesh when replicas are asked for).

The model's stages come from its provider (trainer/provider.py), goodput's decoder included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.config import MeshShape, TrainerConfig, recomputes
from trainer.provider import ModelProvider, Parallelism, is_sharded_root, load_provider

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    """Where this rank computes."""
    backend: str
    """`nccl` on CUDA, `gloo` on CPU."""
    param_dtype: torch.dtype
    """dtype the parameters are kept in (fp32 master weights unless asked otherwise)."""
    compute_dtype: torch.dtype
    """dtype FSDP casts parameters to for compute (bf16 on CUDA under `auto`)."""


def choose_device(dtype: str) -> DeviceChoice:
    """CUDA + NCCL (bf16 compute) when a GPU is visible, CPU + gloo (fp32) otherwise."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        param = _DTYPES.get(dtype, torch.float32)
        compute = torch.bfloat16 if dtype == "auto" else param
        return DeviceChoice(device, "nccl", param, compute)
    param = _DTYPES.get(dtype, torch.float32)
    return DeviceChoice(torch.device("cpu"), "gloo", param, param)


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """A mesh with named axes dp, pp, tp (dp outermost); with replicas, dp is (dp_replicate, dp_shard)."""
    if shape.dp_replicas > 1:
        mesh = init_device_mesh(
            device_type,
            (shape.dp_replicas, shape.dp // shape.dp_replicas, shape.pp, shape.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "pp", "tp"),
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    else:
        mesh = init_device_mesh(device_type, tuple(shape.axes().values()), mesh_dim_names=tuple(shape.axes()))
    _forget_stale_shardings(mesh)
    return mesh


_last_mesh: tuple | None = None
"""What the mesh this process built last looked like (`_mesh_signature`)."""


def _mesh_signature(mesh: DeviceMesh) -> tuple:
    """This rank's place in the mesh and, per axis, the name and members of its process group."""
    axes = []
    for name in (*(mesh.mesh_dim_names or ()), *(("dp",) if "dp_shard" in (mesh.mesh_dim_names or ()) else ())):
        group = mesh[name].get_group()
        axes.append((name, group.group_name, tuple(dist.get_process_group_ranks(group))))
    return (mesh.device_type, dist.get_rank(), dist.get_world_size(), tuple(axes))


def _forget_stale_shardings(mesh: DeviceMesh) -> None:
    """A process that trains a second attempt in place (controller/ray/rank_actor.py) keeps DTensor's
    sharding propagation caches, whose entries hold the old attempt's meshes, and those name their
    process groups. They stay (the warm caches are much of what staying saves) only when every name
    now belongs to a group of the same members, this rank at the same place: the old meshes then
    mean exactly the new one. Otherwise they go, or a cached sharding would run its collectives on
    whatever group now has that name."""
    global _last_mesh
    signature = _mesh_signature(mesh)
    if _last_mesh is not None and _last_mesh != signature:
        from torch.distributed.tensor import DTensor

        torch._C._clear_DTensor_sharding_propagator_cache()
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # this thread's
    _last_mesh = signature


def can_train_again_in_place() -> bool:
    """Whether this torch lets `_forget_stale_shardings` drop DTensor's caches (a private API: a
    process that cannot must not train a second attempt)."""
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    return (hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache")
            and hasattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear"))


def stage_layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Split layers into contiguous, as-even-as-possible stages (earlier stages take the extra)."""
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Loop-style assignment: rank r holds stages r, r + pp, ... (what interleaved schedules expect)."""
    return [pp_rank + v * pp for v in range(stages_per_rank)]


def dp_mesh_of(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    if shape.dp_replicas > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp"]


def build_model_parts(config: TrainerConfig, mesh: DeviceMesh, choice: DeviceChoice,
                      provider: ModelProvider | None = None) -> tuple[list[nn.Module], list[int], int]:
    """The stage modules this rank owns, their stage ids and the total number of stages, built by the
    model's provider (trainer/provider.py): on the meta device, materialised on `choice.device`,
    initialised by parameter name, then parallelised."""
    provider = provider or load_provider(config.model)
    shape, train = config.mesh, config.train
    per_rank = train.schedule.stages_per_rank if shape.pp > 1 else 1
    num_stages = shape.pp * per_rank
    stage_ids = stage_ids_for_rank(mesh["pp"].get_local_rank(), shape.pp, per_rank)
    plan = Parallelism(
        tp_mesh=mesh["tp"] if shape.tp > 1 else None, dp_mesh=dp_mesh_of(mesh, shape),
        mp_policy=MixedPrecisionPolicy(param_dtype=choice.compute_dtype, reduce_dtype=choice.param_dtype),
        # Under a pipeline schedule each layer runs forward several times before its backward:
        # keeping the gathered parameters avoids an all-gather per micro-batch.
        reshard_after_forward=shape.pp == 1,
        recompute=lambda layer: recomputes(train.activation_checkpointing, layer), compile=train.compile)
    parts = []
    ranges = stage_layer_ranges(config.model.layers, num_stages)
    for stage in stage_ids:
        with torch.device("meta"):
            part = provider.build_stage(ranges[stage], first=stage == 0, last=stage == num_stages - 1)
        part.to_empty(device=choice.device)
        part.to(choice.param_dtype)
        provider.init_weights(part, train.seed)
        provider.parallelize(part, plan)
        if not is_sharded_root(part):
            raise ValueError(f"model.provider {config.model.provider}: parallelize() left the stage without FSDP at "
                             "its root (call plan.fully_shard(part, layers))")
        parts.append(part)
    return parts, stage_ids, num_stages


INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo and NCCL read the interfaces their connections bind to (set before any group is made)."""


def use_interface(interface: str | None) -> None:
    """This process's collectives go over `interface` (the spec's cluster.interface), unless the node
    named its own (its environment sets the variable already: the node knows its NICs)."""
    if interface:
        for name in INTERFACE_ENV:
            os.environ.setdefault(name, interface)


def init_process_group(*, rank: int, world_size: int, store: dist.Store, backend: str,
                       timeout_s: float) -> None:
    import datetime

    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
