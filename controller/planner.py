"""`plan_mesh`: choose (dp, tp, pp) for a model on a cluster from a memory model. Pure.

Memory per GPU = static state + activations.
- static: 16 bytes per parameter for mixed-precision Adam (2 bf16 weights + 2 bf16 grads + 12 fp32
  master weights and two moments), sharded by FSDP over dp and split by tp and pp;
- activations: per layer and micro-batch ~ 34 * seq * micro_batch * d_model bytes (Korthikanti et
  al., no recompute; the 5*heads*seq^2 attention-score term is dropped because SDPA/flash attention
  never stores the scores), split by tp; a 1F1B first stage holds up to pp micro-batches of its
  n_layers/pp layers, i.e. about one micro-batch of every layer.
With `parallelism: auto` the smallest model-parallel degree that fits wins, tp (inside a node) before
pp, and dp takes the rest: model parallelism costs communication, dp scales best.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.placement import Placement, PlacementError, place
from controller.spec import RunSpec, SpecError
from controller.topology import NodeState, Topology
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, recomputes

_DUMMY_DATA = DataConfig()

BYTES_PER_PARAM = 16


class PlanError(ValueError):
    """No mesh fits; the message says what is short, in numbers."""


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    mesh: MeshShape
    """The chosen (dp, pp, tp)."""
    memory_per_gpu_bytes: int
    """Estimated peak memory of one GPU."""
    static_bytes_per_gpu: int
    """Parameters, gradients and optimizer state on one GPU."""
    activation_bytes_per_gpu: int
    """Activations held on one GPU (first pipeline stage, worst case)."""
    explanation: str
    """Why this mesh, in a sentence or two."""


def static_state_bytes(num_params: int) -> int:
    """Whole-model static training state: 7B -> 112 GB, 70B -> 1,120 GB."""
    return BYTES_PER_PARAM * num_params


def activation_bytes(model: ModelConfig, micro_batch: int, tp: int, checkpointing: str = "none") -> int:
    """A block that keeps its activations holds 34 * seq * micro_batch * d_model bytes of them, split by
    tp; one that recomputes them (train.activation_checkpointing) keeps only its bf16 input, 2 * seq *
    micro_batch * d_model bytes on every tp rank, and one block's full activations live again while
    it recomputes. A provider's model says its own bytes per token (ModelNumbers)."""
    tokens = model.seq_len * micro_batch
    if model.provider is not None:
        numbers = model.known_numbers()
        full = numbers.activation_bytes_per_token * tokens / tp
        kept_input = numbers.input_bytes_per_token * tokens
    else:
        full = 34 * tokens * model.d_model / tp
        kept_input = 2 * tokens * model.d_model
    recomputing = sum(recomputes(checkpointing, i) for i in range(model.layers))
    keeping = model.layers - recomputing
    return int(keeping * full + recomputing * kept_input + (full if recomputing else 0))


def memory_per_gpu(model: ModelConfig, train: TrainConfig, mesh: MeshShape) -> tuple[int, int]:
    # FSDP shards the static state over dp; HSDP only over dp / dp_replicas (replicas hold copies)
    static = static_state_bytes(model.num_params()) // (mesh.dp // mesh.dp_replicas * mesh.tp * mesh.pp)
    return static, activation_bytes(model, train.micro_batch, mesh.tp, train.activation_checkpointing)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _fits_shape(model: ModelConfig, train: TrainConfig, mesh: MeshShape) -> bool:
    try:
        TrainerConfig(model=model, data=_DUMMY_DATA, train=train, mesh=mesh).validate()
    except ValueError:
        return False
    return True


def plan_mesh(model: ModelConfig, train: TrainConfig, topology: Topology, *,
              fixed: MeshShape | None = None, excluded: frozenset[str] = frozenset()) -> MeshPlan:
    """Pick the mesh (or check the fixed one) for the usable GPUs of `topology`."""
    nodes = topology.usable(excluded)
    if not nodes:
        raise PlanError("no healthy node to place ranks on")
    gpus_per_node = min(n.num_gpus for n in nodes)
    total_gpus = sum(n.num_gpus for n in nodes)
    gpu_mem = min(n.gpu_memory_bytes for n in nodes)
    static_total = static_state_bytes(model.num_params())

    if fixed is not None:
        static, act = memory_per_gpu(model, train, fixed)
        if fixed.world_size > total_gpus:
            raise PlanError(f"dp*pp*tp = {fixed.dp}*{fixed.pp}*{fixed.tp} = {fixed.world_size} GPUs "
                            f"but the healthy nodes offer {total_gpus}")
        if fixed.tp > gpus_per_node:
            raise PlanError(f"tp = {fixed.tp} does not fit in one node of {gpus_per_node} GPUs")
        if static + act > gpu_mem:
            raise PlanError(
                f"mesh dp{fixed.dp} pp{fixed.pp} tp{fixed.tp} needs {_gb(static + act)} per GPU "
                f"({_gb(static)} static + {_gb(act)} activations) but a GPU has {_gb(gpu_mem)}")
        return MeshPlan(mesh=fixed, memory_per_gpu_bytes=static + act, static_bytes_per_gpu=static,
                        activation_bytes_per_gpu=act,
                        explanation=f"mesh fixed by the spec; {_gb(static_total)} of static state "
                                    f"over {fixed.world_size} GPUs")

    candidates = []
    per_step = train.global_batch // train.micro_batch if train.global_batch % train.micro_batch == 0 else 0
    batch_dps = _divisors(per_step) if per_step else []
    for tp in _divisors(gpus_per_node):
        for pp in range(1, model.layers + 1):
            if tp * pp > total_gpus:
                break
            # The largest dp that the batch allows and the GPUs hold.
            limit = total_gpus // (tp * pp)
            dp = max((d for d in batch_dps if d <= limit), default=0)
            if dp and _fits_shape(model, train, MeshShape(dp=dp, pp=pp, tp=tp)):
                candidates.append(MeshShape(dp=dp, pp=pp, tp=tp))
    if not candidates:
        shape = (f"{model.provider}: tp width {model.known_numbers().tp_width}" if model.provider is not None
                 else f"heads {model.n_heads}")
        raise PlanError(f"no (dp, tp, pp) on {total_gpus} GPUs ({gpus_per_node} per node) divides the "
                        f"model ({shape}, layers {model.layers}) and the batch "
                        f"(global {train.global_batch}, micro {train.micro_batch})")
    # Least model parallelism first; tp before pp; then the most dp.
    candidates.sort(key=lambda m: (m.tp * m.pp, m.pp, -m.dp))
    for mesh in candidates:
        static, act = memory_per_gpu(model, train, mesh)
        if static + act <= gpu_mem:
            return MeshPlan(
                mesh=mesh, memory_per_gpu_bytes=static + act, static_bytes_per_gpu=static,
                activation_bytes_per_gpu=act,
                explanation=(f"{model.num_params() / 1e9:.3g}B params need {_gb(static_total)} of static "
                             f"state; tp{mesh.tp} x pp{mesh.pp} is the least model parallelism that fits "
                             f"{_gb(gpu_mem)} GPUs ({_gb(static)} static + {_gb(act)} activations per GPU), "
                             f"dp{mesh.dp} takes the rest"),
            )
    need_gpus = -(-static_total // gpu_mem)
    best = min(candidates, key=lambda m: sum(memory_per_gpu(model, train, m)))
    s, a = memory_per_gpu(model, train, best)
    raise PlanError(
        f"the model needs {_gb(static_total)} of static training state (>= {need_gpus} GPUs of "
        f"{_gb(gpu_mem)} before activations) but the healthy nodes offer {total_gpus} GPUs; the best mesh "
        f"dp{best.dp} pp{best.pp} tp{best.tp} still needs {_gb(s + a)} per GPU")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def plan_run(spec: RunSpec, topology: Topology) -> tuple[MeshPlan, Placement]:
    """Plan and place a spec on a topology; SpecError says what does not fit, in numbers."""
    topology = topology.with_racks(spec.cluster.racks)
    fixed = spec.fixed_mesh()
    if fixed is not None:
        spec.trainer_config(fixed)  # shape errors first: they say more than memory ones
    try:
        plan = plan_mesh(spec.to_model_config(), spec.to_train_config(), topology, fixed=fixed)
        spec.trainer_config(plan.mesh)
        return plan, place(plan.mesh, topology)
    except (PlanError, PlacementError) as e:
        raise SpecError(str(e)) from None


def memory_problem(spec: RunSpec, topology: Topology, mesh: MeshShape) -> str | None:
    """Why `mesh` does not fit the smallest healthy GPU of `topology` by the memory model (None: it fits)."""
    static, act = memory_per_gpu(spec.to_model_config(), spec.to_train_config(), mesh)
    need = static + act
    if need <= topology.smallest_gpu_bytes:
        return None  # fits every GPU of the cluster: no pass over its nodes (16,384 at a time in a simulation)
    gpus = [n.gpu_memory_bytes for n in topology.nodes if n.state in (NodeState.HEALTHY, NodeState.SPARE)]
    if not gpus:
        return None
    if need > min(gpus):
        return f"{need / 2**30:.1f} GiB per GPU > {min(gpus) / 2**30:.1f} GiB"
    return None


def plan_local(spec: RunSpec) -> tuple[MeshPlan, Placement]:
    """Plan and place on the spec's `cluster.local`; SpecError says what does not fit."""
    return plan_run(spec, spec.topology())
