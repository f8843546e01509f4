"""What one attempt of the trainer needs to know: model shape, data source, optimisation and mesh.

Plain frozen dataclasses, importable without torch so the controller can validate a run before any
process starts. `validate()` raises `ValueError` naming the numbers that do not fit.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np

Ranks = TypeVar("Ranks", int, "np.ndarray")
"""A rank, or an array of them (the arithmetic is the same, elementwise)."""


class MeshAxis(str, enum.Enum):
    """Named axes of the device mesh, outermost first."""

    DP = "dp"
    PP = "pp"
    TP = "tp"


class Schedule(str, enum.Enum):
    """Pipeline schedules from torch.distributed.pipelining."""

    ONE_F_ONE_B = "1F1B"
    GPIPE = "GPipe"
    INTERLEAVED_1F1B = "Interleaved1F1B"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self is Schedule.INTERLEAVED_1F1B else 1


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    dp: int = 1
    """Data-parallel degree (FSDP2 shards over it)."""
    pp: int = 1
    """Pipeline stages (ranks along the pipeline)."""
    tp: int = 1
    """Tensor-parallel degree, kept inside one node."""
    dp_replicas: int = 1
    """HSDP: dp = dp_replicas x dp_shard; parameters are replicated across replicas, sharded inside."""

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def axes(self) -> dict[str, int]:
        """{dp, pp, tp} (MeshAxis order): the mesh as events, manifests and the REST API name it."""
        return {axis.value: getattr(self, axis.value) for axis in MeshAxis}

    def rank_coords(self, rank: int) -> dict[str, int]:
        """(dp, pp, tp) coordinates of a global rank in the dp-outermost grid."""
        dp, rest = divmod(rank, self.pp * self.tp)
        pp, tp = divmod(rest, self.tp)
        return {MeshAxis.DP.value: dp, MeshAxis.PP.value: pp, MeshAxis.TP.value: tp}

    def stage_of(self, rank: Ranks) -> Ranks:
        """The pipeline stage (pp coordinate) of a global rank (of each, for an array of ranks)."""
        return (rank % (self.pp * self.tp)) // self.tp

    def validate(self) -> None:
        for name in [axis.value for axis in MeshAxis] + ["dp_replicas"]:
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name} = {getattr(self, name)} but it must be >= 1")
        if self.dp % self.dp_replicas:
            raise ValueError(
                f"parallelism.dp = {self.dp} is not divisible by dp_replicas = {self.dp_replicas}"
            )


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (long context): wavelengths longer than
    `original_max_position / low_freq_factor` are stretched `factor` times, those shorter than
    `original_max_position / high_freq_factor` kept, and the ones between blended smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, kw_only=True)
class ModelNumbers:
    """What the planner needs of a model it cannot count itself (a provider's: trainer/provider.py).
    Pure numbers: the controller plans with them without importing the model's code."""

    n_layers: int
    """Pipeline units: stages take contiguous ranges of them (pp * stages per rank <= n_layers)."""
    parameters: int
    """Every parameter of the whole model (the planner's static memory: 16 bytes each)."""
    flops_per_token: float
    """Training FLOPs per token, forward and backward (6 x parameters for a dense decoder, plus attention's
    12 x layers x width x seq_len)."""
    activation_bytes_per_token: float
    """Bytes one layer keeps for its backward per token at tp = 1 in bf16 (divided by tp)."""
    input_bytes_per_token: float
    """Bytes of one layer's input per token: what a layer that recomputes its activations keeps."""
    tp_width: int = 1
    """Tensor parallelism must divide this (the attention heads, say); 1: the model has no TP plan."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layers: int
    """Transformer blocks."""
    d_model: int
    """Hidden size."""
    n_heads: int
    """Attention (query) heads; split across tp ranks."""
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    seq_len: int
    """Tokens per sample (the model sees seq_len inputs and predicts seq_len targets)."""
    ffn_hidden: int = 0
    """SwiGLU hidden size; 0 means 8/3 * d_model rounded up to a multiple of 32."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads query heads); 0
    means n_heads (multi-head attention). Split across tp ranks too."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's rotary frequency scaling; None: plain RoPE."""
    tie_embeddings: bool = False
    """The output projection is the token embedding table (one parameter, as Llama 3.2 1B/3B have it);
    needs pp = 1, where one stage holds both ends of the model."""
    provider: str | None = None
    """`package.module:function` of a model of the user's own (trainer/provider.py); None: goodput's
    decoder, shaped by the fields above (a provider's model uses only vocab_size and seq_len of them)."""
    provider_args: tuple[tuple[str, object], ...] = ()
    """Keyword arguments of the provider's function."""
    numbers: ModelNumbers | None = None
    """A provider model's numbers, asked of it before planning (controller/providers.py); derived, so
    not part of the state identity."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-8 * self.d_model // 3 // 32) * 32

    @property
    def layers(self) -> int:
        """Pipeline units: goodput's blocks, or a provider's layers."""
        return self.known_numbers().n_layers if self.provider is not None else self.n_layers

    def known_numbers(self) -> ModelNumbers:
        """A provider model's numbers; ValueError if nobody asked it for them yet."""
        if self.numbers is None:
            raise ValueError(f"model.provider {self.provider}: its numbers were not asked of it before planning "
                             "(controller/providers.py does, where the model's code can be imported)")
        return self.numbers

    def num_params(self) -> int:
        """Parameter count, used by the planner's memory model."""
        if self.provider is not None:
            return self.known_numbers().parameters
        d, v = self.d_model, self.vocab_size
        kv = self.kv_heads * self.head_dim
        block = 2 * d * d + 2 * d * kv + 3 * d * self.hidden_dim + 2 * d
        return (1 if self.tie_embeddings else 2) * v * d + self.n_layers * block + d


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    kind: str = "synthetic"
    """`synthetic` (seeded Markov chain of known entropy), `tokens` (flat uint16 file) or `shards`
    (datasets `goodput tokenize` wrote: trainer/shards.py)."""
    seed: int = 0
    """Seed of the data order (and of the synthetic chain)."""
    path: str | None = None
    """For `tokens`: path of the uint16 token file."""
    branching: int = 4
    """For `synthetic`: successors each token can have (sets the entropy rate)."""
    datasets: tuple[tuple[str, float], ...] = ()
    """For `shards`: (uri, weight) of each tokenized dataset; samples mix by weight."""
    source: str | None = None
    """For `python`: package.module:Name of a data source installed in the image (trainer.data.python_source)."""
    args: tuple[tuple[str, object], ...] = ()
    """For `python`: keyword arguments of the source (sorted pairs: the config stays hashable)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int
    """Optimizer steps of the whole run."""
    global_batch: int
    """Samples per optimizer step, whatever the dp degree."""
    micro_batch: int
    """Samples per forward pass on one dp rank."""
    lr: float = 3e-4
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the parameter initialisation."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule when pp > 1."""
    dtype: str = "auto"
    """Parameter dtype: `auto` (bf16 compute on CUDA, fp32 on CPU), `float32` or `float64`."""
    compile: bool = False
    """torch.compile each transformer block in place (names and state unchanged)."""
    warmup_steps: int = 0
    """Steps over which the learning rate rises linearly from lr / warmup_steps to lr."""
    decay: str = "none"
    """After the warmup: `none` (constant lr), `cosine` or `linear`, down to lr * min_lr_ratio at the
    run's last step (`steps`)."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a fraction of lr."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this (0: no clipping)."""
    init_hf: str | None = None
    """A Hugging Face Llama folder (safetensors + config.json, on every node) the first attempt starts
    from instead of random weights (continued pre-training); a resume loads its checkpoint instead."""
    activation_checkpointing: str = "none"
    """`none`, `full` (every block keeps only its input and recomputes the rest in the backward) or
    `selective` (every other block does: TorchTitan's layer-selective choice, half the saving for half
    the recompute)."""

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1 for the first): a pure function of the step."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == "none":
            return self.lr
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    enabled: bool = True
    """Run the health probes: per-step parameter integrity and step-anomaly checks, periodic SDC checks."""
    sdc_every_steps: int = 10
    """Steps between replica fingerprint comparisons and compute self-tests (0: never)."""
    spike_factor: float = 10.0
    """A gradient norm above this x the recent median is an anomaly to triage."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    model: ModelConfig
    """Model shape."""
    data: DataConfig
    """Where samples come from."""
    train: TrainConfig
    """Optimisation and batch."""
    mesh: MeshShape = field(default_factory=MeshShape)
    """Mesh of this attempt."""
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    """Health probes inside the step."""

    def num_microbatches(self) -> int:
        """Micro-batches per dp rank per step (gradient accumulation, or pipeline micro-batches)."""
        return self.train.global_batch // (self.mesh.dp * self.train.micro_batch)

    def validate(self, world_size: int | None = None) -> None:
        """Raise ValueError naming the numbers when this config cannot run on `world_size` ranks."""
        m, t, mesh = self.model, self.train, self.mesh
        mesh.validate()
        if world_size is not None and mesh.world_size != world_size:
            raise ValueError(
                f"dp*pp*tp = {mesh.dp}*{mesh.pp}*{mesh.tp} = {mesh.world_size} "
                f"but there are {world_size} GPU slots to run on"
            )
        if m.provider is not None:
            numbers = m.known_numbers()
            if numbers.tp_width % mesh.tp:
                raise ValueError(f"model.provider {m.provider}: tp = {mesh.tp} does not divide its tensor-parallel "
                                 f"width {numbers.tp_width} (use a divisor of it)")
        else:
            self._validate_decoder()
        if self.data.kind == "tokens" and m.vocab_size > 65536:
            raise ValueError(f"model.vocab_size = {m.vocab_size} does not fit data.kind = 'tokens' (a uint16 file "
                             "holds ids below 65,536)")
        num_stages = mesh.pp * (t.schedule.stages_per_rank if mesh.pp > 1 else 1)
        if m.tie_embeddings and num_stages > 1:
            raise ValueError(f"model.tie_embeddings shares the embedding table with the output projection, which "
                             f"live on the first and the last of {num_stages} pipeline stages here: use pp = 1 "
                             "(tp and dp as you like), or untie them")
        if m.layers < num_stages:
            raise ValueError(
                f"model.n_layers = {m.layers} is fewer than the {num_stages} pipeline stages "
                f"(pp = {mesh.pp}, schedule {t.schedule.value})"
            )
        self._validate_batch_and_train()

    def _validate_decoder(self) -> None:
        """goodput's own decoder: its shape against the mesh."""
        m, mesh = self.model, self.mesh
        if m.d_model % m.n_heads:
            raise ValueError(f"model.d_model = {m.d_model} is not divisible by n_heads = {m.n_heads}")
        if m.head_dim % 2:
            raise ValueError(f"head_dim = d_model/n_heads = {m.head_dim} must be even for rotary embeddings")
        if m.n_heads % mesh.tp:
            raise ValueError(f"model.n_heads = {m.n_heads} is not divisible by tp = {mesh.tp}")
        if m.n_kv_heads < 0 or m.n_heads % m.kv_heads:
            raise ValueError(f"model.n_heads = {m.n_heads} is not a multiple of n_kv_heads = {m.n_kv_heads} "
                             "(each key/value head serves the same number of query heads)")
        if m.kv_heads % mesh.tp:
            raise ValueError(f"model.n_kv_heads = {m.kv_heads} is not divisible by tp = {mesh.tp}: each tp rank "
                             f"needs whole key/value heads (use tp <= {m.kv_heads}, a divisor of it)")
        if m.hidden_dim % mesh.tp:
            raise ValueError(f"model.ffn_hidden = {m.hidden_dim} is not divisible by tp = {mesh.tp}")

    def _validate_batch_and_train(self) -> None:
        m, t, mesh = self.model, self.train, self.mesh
        per_step = mesh.dp * t.micro_batch
        if t.micro_batch < 1 or t.global_batch % per_step:
            raise ValueError(
                f"train.global_batch = {t.global_batch} is not divisible by "
                f"dp * micro_batch = {mesh.dp} * {t.micro_batch} = {per_step}"
            )
        n_micro = self.num_microbatches()
        if mesh.pp > 1 and t.schedule is not Schedule.GPIPE and n_micro < mesh.pp:
            raise ValueError(
                f"schedule {t.schedule.value} needs at least pp = {mesh.pp} micro-batches per step but "
                f"global_batch / (dp * micro_batch) = {t.global_batch} / {per_step} = {n_micro}"
            )
        if mesh.pp > 1 and t.schedule is Schedule.INTERLEAVED_1F1B:
            rounds = max(1, n_micro // mesh.pp)
            if n_micro % rounds:
                raise ValueError(
                    f"Interleaved1F1B needs micro-batches per step ({n_micro}) to be a multiple of "
                    f"{rounds} (micro-batches // pp)"
                )
        if t.steps < 1:
            raise ValueError(f"train.steps = {t.steps} but it must be >= 1")
        if t.activation_checkpointing not in ("none", "selective", "full"):
            raise ValueError(f"train.activation_checkpointing = {t.activation_checkpointing!r}; use none, "
                             "selective or full")
        if t.decay not in ("none", "cosine", "linear"):
            raise ValueError(f"train.decay = {t.decay!r}; use none, cosine or linear")
        if t.warmup_steps < 0 or not 0.0 <= t.min_lr_ratio <= 1.0 or t.grad_clip < 0:
            raise ValueError(f"train.warmup_steps = {t.warmup_steps} (>= 0), min_lr_ratio = {t.min_lr_ratio} "
                             f"(in [0, 1]) and grad_clip = {t.grad_clip} (>= 0, 0: off) are out of range")
        if self.data.kind not in ("synthetic", "tokens", "shards", "python"):
            raise ValueError(f"data.kind = {self.data.kind!r}; use 'synthetic', 'tokens', 'shards' or 'python'")
        if self.data.kind == "python" and not self.data.source:
            raise ValueError("data.kind = 'python' needs data.source (package.module:Name)")
        if self.data.kind == "shards" and (not self.data.datasets or any(w <= 0 for _, w in self.data.datasets)):
            raise ValueError("data.kind = 'shards' needs data.uri (or data.datasets, each with a weight > 0)")
        if self.data.kind == "tokens" and not self.data.path:
            raise ValueError("data.kind = 'tokens' needs data.path (a flat uint16 token file)")
        if self.data.kind == "synthetic" and not 1 <= self.data.branching <= m.vocab_size:
            raise ValueError(
                f"data.branching = {self.data.branching} must be in [1, vocab_size = {m.vocab_size}]"
            )
        if t.dtype not in ("auto", "float32", "float64", "bfloat16"):
            raise ValueError(f"train.dtype = {t.dtype!r}; use auto, float32, float64 or bfloat16")


def recomputes(activation_checkpointing: str, block: int) -> bool:
    """Whether block number `block` (global index) recomputes its activations in the backward."""
    return activation_checkpointing == "full" or (activation_checkpointing == "selective" and block % 2 == 1)


def config_to_dict(config: TrainerConfig) -> dict:
    """JSON-able form, for handing a config to a launcher's child processes."""
    import dataclasses

    out = dataclasses.asdict(config)
    out["train"]["schedule"] = config.train.schedule.value
    return out


def model_from_dict(raw: dict) -> ModelConfig:
    model = dict(raw)
    if model.get("rope_scaling") is not None:
        model["rope_scaling"] = RopeScaling(**model["rope_scaling"])
    if model.get("numbers") is not None:
        model["numbers"] = ModelNumbers(**model["numbers"])
    model["provider_args"] = tuple((str(k), v) for k, v in model.get("provider_args", ()))
    return ModelConfig(**model)


def config_from_dict(raw: dict) -> TrainerConfig:
    train = dict(raw["train"])
    train["schedule"] = Schedule(train.get("schedule", Schedule.ONE_F_ONE_B.value))
    data = dict(raw["data"])
    data["datasets"] = tuple((str(uri), float(weight)) for uri, weight in data.get("datasets", ()))
    data["args"] = tuple((str(k), v) for k, v in data.get("args", ()))
    return TrainerConfig(
        model=model_from_dict(raw["model"]),
        data=DataConfig(**data),
        train=TrainConfig(**train),
        mesh=MeshShape(**raw.get("mesh", {})),
        probes=ProbeConfig(**raw.get("probes", {})),
    )


STATE_LAYOUT = 1
"""How the trainer names and lays out its state (global FQNs per stage, AdamW's flattened optimizer
state). Raise it when a change makes older checkpoints unloadable."""


_IDENTITY_SINCE_V1 = ("n_kv_heads", "rope_scaling", "tie_embeddings", "provider", "provider_args")
"""Model fields added after runs had saved checkpoints: they enter the state identity only where they
change the model (so the runs saved before them keep their fingerprint and stay loadable)."""


def state_identity(model: ModelConfig) -> dict:
    """What shapes a run's saved state: the model, the optimizer and the layout rules (not the mesh,
    which a load reshards, nor the schedule of steps, batch or learning rate, which a resume may change)."""
    fields = asdict(model)
    del fields["numbers"]  # what the planner was told of a provider's model, not the model
    if model.kv_heads == model.n_heads:
        fields["n_kv_heads"] = 0  # the same model, however it is written
    for name in _IDENTITY_SINCE_V1:
        if fields[name] == ModelConfig.__dataclass_fields__[name].default:
            del fields[name]
    return {"model": fields, "optimizer": "adamw", "layout": STATE_LAYOUT}


def state_fingerprint(model: ModelConfig) -> str:
    """A short digest of `state_identity`: the manifest records it, and a load refuses another one."""
    canonical = json.dumps(state_identity(model), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
