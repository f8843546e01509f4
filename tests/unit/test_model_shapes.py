"""Llama 3 shapes: grouped-query attention, Llama 3.1's RoPE scaling, presets by name, and the state
identity of the runs saved before these fields existed. References: the published parameter counts,
an explicit multi-head model with the key/value heads repeated, the scaling rule at its boundaries."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from controller.spec import SpecError, parse_spec
from trainer.config import (
    DataConfig, MeshShape, ModelConfig, RopeScaling, TrainConfig, TrainerConfig, state_fingerprint,
)
from trainer.model import Transformer, rope_frequencies
from trainer.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]


def _spec(model: dict, **parallelism: int):  # type: ignore[no-untyped-def]
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    return parse_spec({**raw, "model": model, **({"parallelism": parallelism} if parallelism else {})})


@pytest.mark.parametrize("name, published", [("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9),
                                             ("llama3-405b", 405.85e9)])
def test_presets_have_the_published_parameter_counts(name: str, published: float) -> None:
    model = _spec({"preset": name}).to_model_config()
    assert model.num_params() == pytest.approx(published, rel=1e-3)
    assert (model.n_kv_heads, model.vocab_size, model.rope_theta) == (8, 128256, 500000.0)
    assert model.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position=8192)


@pytest.mark.parametrize("name, published", [("llama3.2-1b", 1_235_814_400), ("llama3.2-3b", 3_212_749_824)])
def test_tied_presets_have_the_published_parameter_counts(name: str, published: int) -> None:
    """The counts of meta-llama/Llama-3.2-1B and -3B's safetensors (the embedding table counted once)."""
    model = _spec({"preset": name}, pp=1).to_model_config()
    assert model.tie_embeddings and model.num_params() == published
    assert model.rope_scaling is not None and model.rope_scaling.factor == 32.0


def test_tied_embeddings_need_one_pipeline_stage_and_change_the_identity() -> None:
    piped = _spec({"preset": "llama3-tiny", "n_layers": 2, "tie_embeddings": True}, dp=1, pp=2, tp=1)
    with pytest.raises(SpecError, match=r"tie_embeddings .* use pp = 1"):
        piped.trainer_config(piped.fixed_mesh())  # type: ignore[arg-type]
    tied = _spec({"preset": "llama3-tiny", "tie_embeddings": True}, dp=2, pp=1, tp=1).to_model_config()
    untied = _spec({"preset": "llama3-tiny"}, dp=2, pp=1, tp=1).to_model_config()
    assert state_fingerprint(tied) != state_fingerprint(untied)
    with torch.device("meta"):
        names = [n for n, _ in Transformer(tied).named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names


def test_fields_beside_a_preset_override_it_and_an_unknown_preset_names_the_known_ones() -> None:
    model = _spec({"preset": "llama3-8b", "n_layers": 2, "seq_len": 256}).to_model_config()
    assert (model.n_layers, model.seq_len, model.d_model, model.n_kv_heads) == (2, 256, 4096, 8)
    with pytest.raises(SpecError, match="llama3-8b"):
        _spec({"preset": "llama-8b"})


def test_num_params_counts_what_the_module_holds() -> None:
    for name in PRESETS:
        fields = {**PRESETS[name], "n_layers": 1, "d_model": 64, "n_heads": 8, "vocab_size": 100, "ffn_hidden": 96}
        model = _spec({**fields, "n_kv_heads": 2}).to_model_config()
        with torch.device("meta"):
            module = Transformer(model)
        assert model.num_params() == sum(p.numel() for p in module.parameters())


def test_kv_heads_must_divide_the_heads_and_be_divisible_by_tp() -> None:
    model = ModelConfig(n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, vocab_size=64, seq_len=16)

    def config(m: ModelConfig, tp: int) -> TrainerConfig:
        return TrainerConfig(model=m, data=DataConfig(), train=TrainConfig(steps=1, global_batch=4, micro_batch=1),
                             mesh=MeshShape(tp=tp))

    config(model, 2).validate()
    with pytest.raises(ValueError, match=r"n_kv_heads = 2 is not divisible by tp = 4"):
        config(model, 4).validate()
    with pytest.raises(ValueError, match=r"n_heads = 8 is not a multiple of n_kv_heads = 3"):
        config(ModelConfig(**{**model.__dict__, "n_kv_heads": 3}), 1).validate()


def test_grouped_query_attention_equals_multi_head_attention_with_the_kv_heads_repeated() -> None:
    """Query head i of a group of g reads key/value head i // g: the same model as full multi-head
    attention whose wk and wv rows are the grouped ones, each head's block repeated g times."""
    gqa_cfg = ModelConfig(n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, vocab_size=50, seq_len=12)
    mha_cfg = ModelConfig(**{**gqa_cfg.__dict__, "n_kv_heads": 0})
    gqa, mha = Transformer(gqa_cfg).double(), Transformer(mha_cfg).double()
    gqa.init_weights(seed=3)
    head_dim, group = gqa_cfg.head_dim, 4
    with torch.no_grad():
        state = {}
        for name, value in gqa.state_dict().items():
            if name.endswith(("attention.wk.weight", "attention.wv.weight")):
                value = value.view(gqa_cfg.kv_heads, head_dim, -1).repeat_interleave(group, dim=0).reshape(64, 64)
            state[name] = value
        mha.load_state_dict(state)
    tokens = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(gqa(tokens), mha(tokens), rtol=0, atol=1e-12)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * head_dim, 64)


def _hand_scaled(freq: float, s: RopeScaling) -> float:
    """Llama 3.1's rule for one frequency, written out."""
    wavelength = 2 * math.pi / freq
    if wavelength < s.original_max_position / s.high_freq_factor:
        return freq
    if wavelength > s.original_max_position / s.low_freq_factor:
        return freq / s.factor
    smooth = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    return (1 - smooth) * freq / s.factor + smooth * freq


def test_rope_scaling_keeps_short_wavelengths_stretches_long_ones_and_blends_between() -> None:
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    cfg = ModelConfig(n_layers=1, d_model=4096, n_heads=32, vocab_size=10, seq_len=8, rope_theta=500000.0,
                      rope_scaling=scaling)
    plain = rope_frequencies(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
    scaled = rope_frequencies(cfg)
    assert scaled.tolist() == pytest.approx([_hand_scaled(f, scaling) for f in plain.tolist()], rel=1e-12)
    wavelengths = 2 * math.pi / plain
    kept, stretched = wavelengths < 8192 / 4, wavelengths > 8192
    assert kept.any() and stretched.any() and (~kept & ~stretched).any(), "all three regimes are exercised"
    assert torch.equal(scaled[kept], plain[kept]) and torch.allclose(scaled[stretched], plain[stretched] / 8)


def test_runs_saved_before_the_new_fields_keep_their_state_identity() -> None:
    """Fingerprints computed with the code before n_kv_heads and rope_scaling existed (commit 106c7ad)."""
    assert state_fingerprint(ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16)) == \
        "sha256:9230d9ba181acebd"
    assert state_fingerprint(ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32,
                                         ffn_hidden=128, rope_theta=500000.0)) == "sha256:2c02bd403475fedf"
    same = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, vocab_size=64, seq_len=16)
    assert state_fingerprint(same) == "sha256:9230d9ba181acebd", "n_kv_heads = n_heads is the same model"
    grouped = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16)
    scaled = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16, rope_scaling=RopeScaling())
    assert len({state_fingerprint(m) for m in (same, grouped, scaled)}) == 3


def _saved_bytes_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for the backward (counted as they are saved), and the gradients."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1]).logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return saved, grads


def test_activation_checkpointing_keeps_less_and_changes_no_gradient() -> None:
    """Every block recomputing (full) or every other one (selective): the same gradients bit for bit,
    and autograd keeps less for the backward (the blocks' inputs instead of their insides)."""
    from trainer.config import recomputes

    cfg = ModelConfig(n_layers=4, d_model=64, n_heads=8, n_kv_heads=2, vocab_size=50, seq_len=32)
    model = Transformer(cfg).double()
    model.init_weights(seed=1)
    tokens = torch.randint(0, 50, (2, 33), generator=torch.Generator().manual_seed(0))
    saved = {}
    for mode in ("none", "selective", "full"):
        for index, block in model.layers.items():
            block.recompute = recomputes(mode, int(index))  # type: ignore[union-attr]
        saved[mode], grads = _saved_bytes_and_grads(model, tokens)
        if mode == "none":
            reference = grads
        for name, grad in grads.items():
            assert torch.equal(grad, reference[name]), f"{mode}: {name}"
    assert saved["full"] < saved["selective"] < saved["none"], saved
    assert saved["full"] < 0.5 * saved["none"], saved


def test_the_planner_counts_what_activation_checkpointing_keeps() -> None:
    from controller.planner import activation_bytes

    model = ModelConfig(n_layers=4, d_model=1024, n_heads=8, vocab_size=100, seq_len=2048)
    full_layer, kept_input = 34 * 2048 * 1024 / 2, 2 * 2048 * 1024
    assert activation_bytes(model, 1, 2) == 4 * full_layer
    assert activation_bytes(model, 1, 2, "full") == 4 * kept_input + full_layer
    assert activation_bytes(model, 1, 2, "selective") == 2 * full_layer + 2 * kept_input + full_layer
