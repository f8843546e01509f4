"""The model provider contract: what a model brings to goodput's training loop, and what it must uphold.

goodput keeps the loop (the probes need the gradients before the optimizer step and a step they can
re-run; the snapshots and checkpoints need the whole state); a model plugs in through five methods.
`model: {provider: "package.module:function", args: {...}, vocab_size: V, seq_len: S}` names a
function installed in the image (never code sent over the API); goodput calls it with
`vocab_size=`, `seq_len=` and the args, on every rank and in the controller, and it returns an object
with:

- `numbers() -> ModelNumbers`: what the planner needs (parameters, layers, FLOPs and activation bytes
  per token, the width tensor parallelism must divide). The controller asks before it plans.
- `build_stage(layers, first=, last=) -> nn.Module`: the pipeline stage that holds `layers` (a range
  of layer indices), the input end if `first`, the output end if `last`; called under
  `torch.device("meta")`. Parameter names are global: a parameter has the same name whichever stage,
  rank or mesh holds it (a checkpoint reshards by name).
- `init_weights(part, seed)`: every parameter from a generator seeded by (seed, its name) alone
  (`seeded`), so that a stage equals the matching slice of a one-process model.
- `parallelize(part, plan: Parallelism)`: apply tensor parallelism on `plan.tp_mesh` (if not None),
  activation checkpointing where `plan.recompute(layer)` says, and FSDP2 (`plan.fully_shard(part,
  units)`: each unit, then the stage root). Parameter names must stay as they are.
- `loss(output, targets) -> Tensor`: the mean loss of a micro-batch, in at least float32.

And what it must not do: touch CUDA when imported (ranks are forked from a warm image that imported
it), or draw randomness anywhere but from `seeded` generators. goodput's own decoder is the provider
`Decoder` below, through the same contract.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trainer.config import ModelConfig, ModelNumbers
from trainer.model import Block, Transformer, cross_entropy
from trainer.model import seeded as seeded  # part of the contract: a provider initialises from it


@dataclass(frozen=True)
class Parallelism:
    """What goodput asks of a stage's parallelisation (`ModelProvider.parallelize`)."""

    tp_mesh: DeviceMesh | None
    """Tensor parallelism (None: tp = 1)."""
    dp_mesh: DeviceMesh
    """Data parallelism, FSDP2's mesh (two dimensions for HSDP)."""
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool
    """False under a pipeline schedule (each layer runs forward for several micro-batches first)."""
    recompute: Callable[[int], bool]
    """Whether the layer with this global index recomputes its activations in the backward."""
    compile: bool
    """train.compile: compile each layer in place (names unchanged)."""

    def fully_shard(self, part: nn.Module, units: Iterable[nn.Module]) -> None:
        """FSDP2 on each unit (a layer, typically), then on the stage root."""
        for unit in units:
            fully_shard(unit, mesh=self.dp_mesh, mp_policy=self.mp_policy,
                        reshard_after_forward=self.reshard_after_forward)
        fully_shard(part, mesh=self.dp_mesh, mp_policy=self.mp_policy, reshard_after_forward=self.reshard_after_forward)


@runtime_checkable
class ModelProvider(Protocol):
    def numbers(self) -> ModelNumbers: ...

    def build_stage(self, layers: range, *, first: bool, last: bool) -> nn.Module: ...

    def init_weights(self, part: nn.Module, seed: int) -> None: ...

    def parallelize(self, part: nn.Module, plan: Parallelism) -> None: ...

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


CONTRACT = ("numbers", "build_stage", "init_weights", "parallelize", "loss")


class Decoder:
    """goodput's own Llama-style decoder (trainer/model.py) as a provider."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model

    def numbers(self) -> ModelNumbers:
        m = self.model
        attention = 12 * m.n_layers * m.seq_len * m.d_model  # QK^T and AV, forward and backward (PaLM)
        return ModelNumbers(n_layers=m.n_layers, parameters=m.num_params(),
                            flops_per_token=6 * m.num_params() + attention,
                            activation_bytes_per_token=34 * m.d_model, input_bytes_per_token=2 * m.d_model,
                            tp_width=m.kv_heads)

    def build_stage(self, layers: range, *, first: bool, last: bool) -> nn.Module:
        return Transformer(self.model).keep_only(layers, first=first, last=last)

    def init_weights(self, part: nn.Module, seed: int) -> None:
        assert isinstance(part, Transformer)
        part.init_weights(seed)

    def parallelize(self, part: nn.Module, plan: Parallelism) -> None:
        assert isinstance(part, Transformer)
        for index, block in part.layers.items():
            assert isinstance(block, Block)
            block.recompute = plan.recompute(int(index))
        if plan.tp_mesh is not None:
            apply_tp(part, plan.tp_mesh)
        if plan.compile:  # in place, per block (as TorchTitan does): parameter names stay as they are
            for block in part.layers.values():
                block.compile()
        plan.fully_shard(part, part.layers.values())

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(output, targets)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP inside each block; embeddings, norms and the head stay replicated."""
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )


def load_provider(model: ModelConfig) -> ModelProvider:
    """The provider of `model`: goodput's decoder, or the user's function called with vocab_size,
    seq_len and its args. ValueError saying what to fix when it cannot be had."""
    if model.provider is None:
        return Decoder(model)
    module_name, _, function_name = model.provider.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model.provider {model.provider}: cannot import {module_name} ({e}); it must be "
                         "installed in the image of every node and of the controller") from None
    build: Any = getattr(module, function_name, None)
    if not callable(build):
        raise ValueError(f"model.provider {model.provider}: {module_name} has no function {function_name}")
    try:
        provider = build(vocab_size=model.vocab_size, seq_len=model.seq_len, **dict(model.provider_args))
    except TypeError as e:
        raise ValueError(f"model.provider {model.provider}: its function does not take these arguments "
                         f"(vocab_size, seq_len and model.args {sorted(dict(model.provider_args))}): {e}") from None
    missing = [name for name in CONTRACT if not callable(getattr(provider, name, None))]
    if missing:
        raise ValueError(f"model.provider {model.provider} returned a {type(provider).__name__} without "
                         f"{', '.join(missing)} (trainer/provider.py's contract)")
    return provider  # type: ignore[no-any-return]


def ask_numbers(model: ModelConfig) -> ModelNumbers:
    """A provider's numbers, checked (the planner divides by them)."""
    numbers = load_provider(model).numbers()
    if not isinstance(numbers, ModelNumbers):
        raise ValueError(f"model.provider {model.provider}: numbers() returned a {type(numbers).__name__}, "
                         "not trainer.config.ModelNumbers")
    bad = [f"{name} = {getattr(numbers, name)}" for name in ("n_layers", "parameters", "flops_per_token", "tp_width")
           if not getattr(numbers, name) > 0]
    if bad or numbers.activation_bytes_per_token < 0 or numbers.input_bytes_per_token < 0:
        raise ValueError(f"model.provider {model.provider}: numbers() out of range ({', '.join(bad) or 'bytes < 0'})")
    return numbers


def is_sharded_root(part: nn.Module) -> bool:
    return isinstance(part, FSDPModule)
