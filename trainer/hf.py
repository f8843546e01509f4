"""Hugging Face Llama weights in and out: safetensors and a `config.json` that transformers'
`LlamaForCausalLM.from_pretrained` loads (transformers itself is only a test dependency here).

goodput's decoder is Llama's: the same RMSNorm, SwiGLU and rotary convention (rotate the two halves
of each head, as Hugging Face's Llama checkpoints are laid out), so the conversion is names only.
Pure of goodput's training stack: torch and safetensors, no process group.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from trainer.config import ModelConfig, RopeScaling

_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_name(name: str) -> str:
    """goodput's parameter name -> Hugging Face Llama's."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER:
        raise ValueError(f"{name}: not a parameter of goodput's Llama decoder")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def goodput_name(name: str) -> str:
    """Hugging Face Llama's parameter name -> goodput's."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LAYER_BACK:
        raise ValueError(f"{name}: not a parameter of a Llama model goodput can train")
    return f"layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"


def hf_config(model: ModelConfig, dtype: str) -> dict[str, Any]:
    """The `config.json` of `model` as Hugging Face's LlamaConfig reads it."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": model.d_model, "intermediate_size": model.hidden_dim,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim, "vocab_size": model.vocab_size,
        "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": model.seq_len, "tie_word_embeddings": model.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": dtype, "rope_scaling": None,
    }
    if model.rope_scaling is not None:
        s = model.rope_scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position}
        config["max_position_embeddings"] = max(model.seq_len, int(s.original_max_position * s.factor))
    return config


def model_from_hf_config(config: dict[str, Any], *, seq_len: int) -> ModelConfig:
    """The ModelConfig a Hugging Face Llama `config.json` describes (training at `seq_len`);
    ValueError naming what goodput's decoder does not have."""
    if config.get("model_type") != "llama":
        raise ValueError(f"model_type {config.get('model_type')!r}: goodput reads Llama checkpoints")
    for key, plain in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if config.get(key, plain) != plain:
            raise ValueError(f"{key} = {config[key]!r}: goodput's decoder has {key} = {plain!r}")
    heads = int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        raise ValueError(f"head_dim = {config['head_dim']} is not hidden_size / num_attention_heads")
    scaling = config.get("rope_scaling") or None
    rope = config.get("rope_theta")
    parameters = config.get("rope_parameters")  # transformers 5 writes the rope fields here
    if isinstance(parameters, dict):
        rope = parameters.get("rope_theta", rope)
        if parameters.get("rope_type") not in (None, "default"):
            scaling = parameters
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"rope_scaling {scaling}: goodput has Llama 3's (rope_type llama3) or none")
    return ModelConfig(
        n_layers=int(config["num_hidden_layers"]), d_model=int(config["hidden_size"]), n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads), vocab_size=int(config["vocab_size"]),
        seq_len=seq_len, ffn_hidden=int(config["intermediate_size"]), rope_theta=float(rope or 10000.0),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=None if scaling is None else RopeScaling(
            factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position=int(scaling["original_max_position_embeddings"])))


def save_hf(folder: Path, model: ModelConfig, state: dict[str, torch.Tensor], *, dtype: str = "bfloat16") -> None:
    """Write `state` (goodput's full parameter names and shapes) as model.safetensors + config.json."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(name): value.detach().to(_DTYPES[dtype]).contiguous() for name, value in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))


def check_same_model(theirs: ModelConfig, ours: ModelConfig, folder: Path) -> None:
    """ValueError naming every field in which a Hugging Face folder's model differs from the run's."""
    diff = [f"{name} {getattr(theirs, name)} there, {getattr(ours, name)} here"
            for name in ("n_layers", "d_model", "n_heads", "kv_heads", "vocab_size", "hidden_dim", "rope_theta",
                         "norm_eps", "rope_scaling", "tie_embeddings") if getattr(theirs, name) != getattr(ours, name)]
    if diff:
        raise ValueError(f"{folder} holds another model than the run's ({'; '.join(diff)}): set model to its "
                         "shape (a preset and overrides) or point model.init.hf at the right folder")


def load_into(trainer: Any, folder: Path) -> int:
    """Replace the trainer's freshly initialised parameters with a Hugging Face Llama folder's (each
    rank reads only its pipeline stages' tensors; DCP's state-dict API shards them over FSDP and TP);
    the number of tensors loaded."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model.init.hf = {folder}: no config.json (a Hugging Face model folder has one)")
    ours = trainer.config.model
    check_same_model(model_from_hf_config(json.loads(config_path.read_text()), seq_len=ours.seq_len), ours, folder)
    where: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if ours.tie_embeddings and name == "lm_head.weight":
                    continue  # a tied model's head is its embedding table (some exports write it twice)
                where[goodput_name(name)] = path
    loaded = 0
    for part in trainer.parts:
        wanted = [name for name, _ in part.named_parameters()]
        missing = [name for name in wanted if name not in where]
        if missing:
            raise ValueError(f"{folder} lacks {len(missing)} tensor(s) of the model, e.g. {hf_name(missing[0])}")
        full: dict[str, torch.Tensor] = {}
        for path in {where[name] for name in wanted}:
            with safe_open(str(path), framework="pt") as f:
                for name in wanted:
                    if where[name] == path:
                        full[name] = f.get_tensor(hf_name(name))
        dtype = next(part.parameters()).dtype
        typed: dict[str, Any] = {name: value.to(dtype) for name, value in full.items()}
        set_model_state_dict(part, typed, options=StateDictOptions(full_state_dict=True))
        loaded += len(full)
    return loaded


def load_hf(folder: Path, *, seq_len: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face Llama folder (config.json and one or several .safetensors files) as goodput's
    ModelConfig and full parameters by goodput's names."""
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder}: no config.json (a Hugging Face model folder has one)")
    model = model_from_hf_config(json.loads(config_path.read_text()), seq_len=seq_len)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors files")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        for name, value in load_file(str(path)).items():
            if model.tie_embeddings and name == "lm_head.weight":
                continue  # a tied model's head is its embedding table (some exports write it twice)
            state[goodput_name(name)] = value
    return model, state
