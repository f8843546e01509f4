"""Hugging Face Llama weights out and in: what goodput writes, transformers' LlamaForCausalLM loads and
computes the same loss on the same tokens (to 1e-4 relative: the independent reference), and reading
it back gives the same model and tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.config import ModelConfig, RopeScaling
from trainer.hf import goodput_name, hf_name, load_hf, model_from_hf_config, save_hf
from trainer.model import Transformer, cross_entropy

# GQA (2 key/value heads for 4), RoPE base 500,000 and Llama 3.1's scaling with an original context of
# 64, so that at this head size the kept, blended and stretched frequencies all occur.
MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=300, seq_len=32, ffn_hidden=96,
                    rope_theta=500000.0, rope_scaling=RopeScaling(original_max_position=64))


def test_names_map_both_ways() -> None:
    with torch.device("meta"):
        names = [n for n, _ in Transformer(MODEL).named_parameters()]
    assert [goodput_name(hf_name(n)) for n in names] == names
    assert hf_name("layers.1.feed_forward.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match="not a parameter"):
        hf_name("layers.0.attention.bias")


def test_transformers_loads_the_export_and_computes_the_same_loss(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    ours = Transformer(MODEL)
    ours.init_weights(seed=7)
    with torch.no_grad():  # sharper attention than at initialisation: positions (the rotary part) matter
        for name, p in ours.named_parameters():
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(30)
    save_hf(tmp_path / "hf", MODEL, ours.state_dict(), dtype="float32")
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, MODEL.vocab_size, (3, MODEL.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        our_logits = ours(tokens[:, :-1])
        our_loss = float(cross_entropy(our_logits, tokens[:, 1:]))
        logits = theirs(input_ids=tokens[:, :-1]).logits
        their_loss = float(F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))
    assert abs(our_loss - their_loss) <= 1e-4 * their_loss, (our_loss, their_loss)
    close = (our_logits - logits).abs().max().item()
    assert close < 1e-4, close
    # the rotary scaling is part of what was compared: without it the same weights give other logits
    plain = ModelConfig(**{**MODEL.__dict__, "rope_scaling": None})
    unscaled = Transformer(plain)
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unscaled(tokens[:, :-1]) - logits).abs().max().item() > 100 * close


def test_reading_an_export_back_gives_the_same_model_and_tensors(tmp_path: Path) -> None:
    ours = Transformer(MODEL)
    ours.init_weights(seed=3)
    save_hf(tmp_path / "hf", MODEL, ours.state_dict(), dtype="float32")
    model, state = load_hf(tmp_path / "hf", seq_len=MODEL.seq_len)
    assert model == MODEL
    assert state.keys() == ours.state_dict().keys()
    assert all(torch.equal(state[n], v) for n, v in ours.state_dict().items())


def test_a_tied_model_round_trips_through_transformers(tmp_path: Path) -> None:
    """Tied embeddings (Llama 3.2's 1B/3B): one table, written once; transformers ties its head to it
    and computes the same loss; reading the folder back gives the tied model again."""
    from transformers import LlamaForCausalLM

    tied = ModelConfig(**{**MODEL.__dict__, "tie_embeddings": True})
    ours = Transformer(tied)
    ours.init_weights(seed=5)
    assert "output.weight" not in ours.state_dict()
    save_hf(tmp_path / "hf", tied, ours.state_dict(), dtype="float32")
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert theirs.config.tie_word_embeddings
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, tied.vocab_size, (3, tied.seq_len + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        our_loss = float(cross_entropy(ours(tokens[:, :-1]), tokens[:, 1:]))
        their_loss = float(F.cross_entropy(theirs(input_ids=tokens[:, :-1]).logits.flatten(0, 1).float(),
                                           tokens[:, 1:].flatten()))
    assert abs(our_loss - their_loss) <= 1e-4 * their_loss, (our_loss, their_loss)
    model, state = load_hf(tmp_path / "hf", seq_len=tied.seq_len)
    assert model == tied and state.keys() == ours.state_dict().keys()


def test_a_config_goodput_cannot_train_is_refused_with_the_reason() -> None:
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
    assert model_from_hf_config(base, seq_len=16).n_kv_heads == 2
    assert model_from_hf_config({**base, "tie_word_embeddings": True}, seq_len=16).tie_embeddings
    with pytest.raises(ValueError, match="attention_bias"):
        model_from_hf_config({**base, "attention_bias": True}, seq_len=16)
    with pytest.raises(ValueError, match="rope_type llama3"):
        model_from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, seq_len=16)
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        model_from_hf_config({**base, "model_type": "mistral"}, seq_len=16)
