"""A Llama-style decoder: RMSNorm, rotary embeddings (with Llama 3.1's frequency scaling), SwiGLU MLP,
causal attention with grouped-query heads (Llama 3's shapes: trainer/presets.py).

Written for the parallelism around it: attention derives its head counts from the width of its
projections, so a TP-sharded wq and wk/wv (n_heads/tp and n_kv_heads/tp heads per rank) just work; blocks live in a ModuleDict
keyed by their global index so a pipeline stage keeps the same parameter names as the whole model
(DCP loads across meshes by name); the first and last stage alone own the embedding and the head.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary angular frequencies (head_dim // 2 of them, float64), scaled as Llama 3.1 does when
    `cfg.rope_scaling` is set: a wavelength longer than original_max_position / low_freq_factor is
    stretched `factor` times, one shorter than original_max_position / high_freq_factor is kept, and
    between the two the frequency blends from scaled to kept as the wavelength shortens."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    wavelength = 2 * torch.pi / inv_freq
    long_from = scaling.original_max_position / scaling.low_freq_factor
    short_below = scaling.original_max_position / scaling.high_freq_factor
    blend = ((scaling.original_max_position / wavelength - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    return torch.where(wavelength < short_below, inv_freq,
                       torch.where(wavelength > long_from, inv_freq / scaling.factor, scaled))


def rope_tables(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2)."""
    inv_freq = rope_frequencies(cfg)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x: (batch, seq, heads, head_dim)."""
    seq = x.shape[1]
    c, s = cos[:seq, None, :], sin[:seq, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.kv_heads
        """Query heads per key/value head (1: multi-head attention)."""
        kv = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp query and n_kv_heads / tp key/value heads
        # (query head i uses key/value head i // group, on every rank: tp divides both counts).
        q = apply_rope(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=2), v.repeat_interleave(self.group, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def seeded(seed: int, name: str) -> torch.Generator:
    """The generator a parameter named `name` is initialised from (CPU; draw, then copy to the device):
    a function of (seed, name) alone, whichever stage, rank or mesh holds the parameter."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.recompute = False
        """Activation checkpointing: keep only the block's input and recompute the rest in the backward
        (set by trainer/parallel.py from train.activation_checkpointing; names and state unchanged,
        unlike a wrapper module)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (see `keep_only`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        # Tied: the last stage projects onto the embedding table (the same stage holds it: pp = 1).
        self.output: nn.Linear | None = (None if cfg.tie_embeddings else
                                         nn.Linear(cfg.d_model, cfg.vocab_size, bias=False))
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep_only(self, layer_ids: range, *, first: bool, last: bool) -> "Transformer":
        """Drop what this pipeline stage does not own; parameter names stay global."""
        for key in list(self.layers.keys()):
            if int(key) not in layer_ids:
                del self.layers[key]
        if self.cfg.tie_embeddings and not (first and last):
            raise ValueError("model.tie_embeddings needs the whole model in one pipeline stage (pp = 1)")
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = None
            self.output = None
        return self

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from a generator seeded by (seed, its name).

        A parameter gets the same values whichever stage, rank or mesh builds it, so a pipeline stage
        equals the matching slice of a single-process model.
        """
        for name, param in self.named_parameters():
            gen = seeded(seed, name)
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape, dtype=torch.float64)
            else:
                std = 0.02 / (2 * self.cfg.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
                values = torch.randn(param.shape, generator=gen, dtype=torch.float64) * std
            param.copy_(values.to(param.dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        if self._rope is None or self._rope[0].device != h.device or self._rope[0].dtype != h.dtype:
            self._rope = rope_tables(self.cfg, h.device, h.dtype)
        cos, sin = self._rope
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        elif self.cfg.tie_embeddings and self.norm is not None:  # the last stage, tied
            assert self.tok_embeddings is not None
            h = F.linear(h, self.tok_embeddings.weight)
        return h


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in at least fp32."""
    logits = logits.flatten(0, 1)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, targets.flatten(0, 1))
