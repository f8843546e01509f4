"""Model shapes by name (`model: {preset: llama3-8b}` in a run spec); fields given beside the preset
override it (`n_layers: 4` cuts a Llama-3-8B-wide model to four blocks).

The Llama 3.1 shapes are Meta's published ones (the `config.json` of meta-llama/Llama-3.1-8B, -70B and
-405B; the same numbers as TorchTitan's llama3 registry): grouped-query attention with 8 key/value
heads, a 128,256-token vocabulary, RoPE base 500,000 with Llama 3.1's frequency scaling, untied
embeddings. Llama 3.2's 1B and 3B (meta-llama/Llama-3.2-1B and -3B) tie the output projection to
the embedding table and scale RoPE by 32. `seq_len` is the training context a run chooses; the presets
say 8,192 (Llama 3's pre-training length). `llama3-tiny` is the same architecture at a size a CPU test trains in seconds.
Pure: no torch.
"""

from __future__ import annotations

from typing import Any

from trainer.config import RopeScaling

_LLAMA31_ROPE: dict[str, Any] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position": 8192}

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
                      seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, rope_scaling=_LLAMA31_ROPE),
    "llama3-70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=128256,
                       seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, rope_scaling=_LLAMA31_ROPE),
    "llama3-405b": dict(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                        vocab_size=128256, seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                        rope_scaling=_LLAMA31_ROPE),
    "llama3.2-1b": dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                        rope_scaling={**_LLAMA31_ROPE, "factor": 32.0}),
    "llama3.2-3b": dict(n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                        rope_scaling={**_LLAMA31_ROPE, "factor": 32.0}),
    "llama3-tiny": dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=512, seq_len=32,
                        rope_theta=500000.0, norm_eps=1e-5,
                        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position": 64}),
}
"""name -> ModelConfig fields (rope_scaling as a dict of RopeScaling's fields)."""


def preset_fields(name: str) -> dict[str, Any]:
    """A preset's ModelConfig fields; ValueError naming the presets there are."""
    if name not in PRESETS:
        raise ValueError(f"model.preset = {name!r} is not a preset; use one of {', '.join(sorted(PRESETS))}")
    fields = dict(PRESETS[name])
    fields["rope_scaling"] = dict(fields["rope_scaling"]) if fields.get("rope_scaling") else None
    return fields


def rope_scaling(fields: dict[str, Any] | None) -> RopeScaling | None:
    return RopeScaling(**fields) if fields else None
