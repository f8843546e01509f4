"""An example model provider: a GPT-2-shaped decoder (learned positions, LayerNorm with biases, GELU MLP,
biased attention projections), which goodput's own Llama-style decoder is not. Name it in a run spec:

    model:
      provider: examples.gpt2_provider:build
      args: {n_layers: 4, d_model: 64, n_heads: 4}
      vocab_size: 512
      seq_len: 64

It implements trainer/provider.py's contract: stages built on the meta device with global parameter
names (`h.3.attn.q.weight` on whichever stage holds layer 3), every parameter initialised from a
generator seeded by its name, tensor parallelism Megatron-style inside each layer, activation
checkpointing per layer, FSDP2 per layer and at the stage root, its loss and its numbers. Nothing here
touches CUDA at import. tests/dist/test_provider.py trains it on dp2 x pp2 x tp2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from trainer.config import ModelNumbers
from trainer.provider import Parallelism, seeded


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    seq_len: int
    n_layers: int
    d_model: int
    n_heads: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.head_dim = s.head_dim
        self.q = nn.Linear(s.d_model, s.d_model)
        self.k = nn.Linear(s.d_model, s.d_model)
        self.v = nn.Linear(s.d_model, s.d_model)
        self.proj = nn.Linear(s.d_model, s.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.fc = nn.Linear(s.d_model, 4 * s.d_model)
        self.proj = nn.Linear(4 * s.d_model, s.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.d_model)
        self.attn = Attention(s)
        self.ln_2 = nn.LayerNorm(s.d_model)
        self.mlp = MLP(s)
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Stage(nn.Module):
    """Layers `layers` of the model, with the embeddings if first and the head if last."""

    def __init__(self, s: Shape, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab_size, s.d_model) if first else None
        self.wpe = nn.Embedding(s.seq_len, s.d_model) if first else None
        self.h = nn.ModuleDict({str(i): Layer(s) for i in layers})
        self.ln_f = nn.LayerNorm(s.d_model) if last else None
        self.lm_head = nn.Linear(s.d_model, s.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None and self.wpe is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for layer in self.h.values():
            x = layer(x)
        if self.ln_f is not None and self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


class GPT2Provider:
    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def numbers(self) -> ModelNumbers:
        s = self.shape
        d, v = s.d_model, s.vocab_size
        layer = 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d  # attn, fc, proj, two norms
        parameters = v * d + s.seq_len * d + s.n_layers * layer + 2 * d + v * d
        return ModelNumbers(n_layers=s.n_layers, parameters=parameters,
                            flops_per_token=6 * parameters + 12 * s.n_layers * s.seq_len * d,
                            activation_bytes_per_token=34 * d, input_bytes_per_token=2 * d, tp_width=s.n_heads)

    def build_stage(self, layers: range, *, first: bool, last: bool) -> nn.Module:
        return Stage(self.shape, layers, first=first, last=last)

    @torch.no_grad()
    def init_weights(self, part: nn.Module, seed: int) -> None:
        residual_std = 0.02 / (2 * self.shape.n_layers) ** 0.5  # GPT-2's scaled residual projections
        for name, param in part.named_parameters():
            if ".ln_" in name or name.startswith("ln_f"):
                values = torch.ones(param.shape) if name.endswith("weight") else torch.zeros(param.shape)
            elif name.endswith("bias"):
                values = torch.zeros(param.shape)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.01 if name == "wpe.weight" else 0.02
                values = torch.randn(param.shape, generator=seeded(seed, name), dtype=torch.float64) * std
            param.copy_(values.to(param.dtype))

    def parallelize(self, part: nn.Module, plan: Parallelism) -> None:
        assert isinstance(part, Stage)
        for index, layer in part.h.items():
            assert isinstance(layer, Layer)
            layer.recompute = plan.recompute(int(index))
            if plan.tp_mesh is not None:
                parallelize_module(layer, plan.tp_mesh, {
                    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                    "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
                })
            if plan.compile:
                layer.compile()
        plan.fully_shard(part, part.h.values())

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if output.dtype in (torch.bfloat16, torch.float16):
            output = output.float()
        return F.cross_entropy(output.flatten(0, 1), targets.flatten(0, 1))


def build(*, vocab_size: int, seq_len: int, n_layers: int = 4, d_model: int = 64, n_heads: int = 4) -> GPT2Provider:
    if d_model % n_heads:
        raise ValueError(f"d_model = {d_model} is not divisible by n_heads = {n_heads}")
    return GPT2Provider(Shape(vocab_size=vocab_size, seq_len=seq_len, n_layers=n_layers, d_model=d_model,
                              n_heads=n_heads))
