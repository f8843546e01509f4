"""The run spec: the YAML a user writes and the body of `POST /v1/runs`, validated at the boundary.

Unknown keys are errors (a typo must not silently fall back to a default). `trainer_config(mesh)`
turns a spec into the trainer's frozen config for one attempt's mesh. Imports no ray/torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from checkpointing.store import ObjectStore, StoreError, open_store
from controller.drills import DrillKind, domain_problem, params_problem
from trainer.config import (
    DataConfig, MeshShape, ModelConfig, ModelNumbers, ProbeConfig, RopeScaling, Schedule, TrainConfig, TrainerConfig,
)

if TYPE_CHECKING:
    from controller.topology import Topology


class SpecError(ValueError):
    """A spec that cannot run; the message says what to fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    """Unknown fields are refused; a field's docstring is its description (the JSON schema, the reference)."""


class RopeScalingSpec(_Strict):
    """Llama 3.1's rotary frequency scaling (trainer.config.RopeScaling)."""
    factor: float = Field(default=8.0, gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position: int = Field(default=8192, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "RopeScalingSpec":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor = {self.high_freq_factor} must be above "
                             f"low_freq_factor = {self.low_freq_factor}")
        return self


class ModelInitSpec(_Strict):
    hf: str
    """A Hugging Face Llama folder (config.json + safetensors), at this path on every node."""


class ModelNumbersSpec(_Strict):
    """ModelNumbers: asked of a provider where its code can be imported (controller/providers.py),
    never taken from a user."""
    n_layers: int = Field(gt=0)
    parameters: int = Field(gt=0)
    flops_per_token: float = Field(gt=0)
    activation_bytes_per_token: float = Field(ge=0)
    input_bytes_per_token: float = Field(ge=0)
    tp_width: int = Field(default=1, gt=0)


class ModelSpec(_Strict):
    """The model's shape: every field, or a `preset` (trainer/presets.py) and the fields that differ;
    `init: {hf: DIR}` starts a new run from a Hugging Face checkpoint of that shape. Or a model of
    one's own: `provider: package.module:function` (installed in the image; trainer/provider.py),
    its `args`, and the `vocab_size` and `seq_len` the data must have."""
    preset: str | None = None
    init: ModelInitSpec | None = None
    provider: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """`package.module:function`: returns the model's provider (trainer/provider.py's contract)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """The provider function's keyword arguments (JSON values)."""
    numbers: ModelNumbersSpec | None = None
    n_layers: int = Field(default=0, ge=0)
    d_model: int = Field(default=0, ge=0)
    n_heads: int = Field(default=0, ge=0)
    vocab_size: int = Field(gt=1, le=262144)
    seq_len: int = Field(gt=0)
    ffn_hidden: int = Field(default=0, ge=0)
    n_kv_heads: int = Field(default=0, ge=0)
    """Key/value heads (grouped-query attention); 0: as many as n_heads."""
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    rope_scaling: RopeScalingSpec | None = None
    tie_embeddings: bool = False
    """The output projection is the embedding table (needs pp = 1)."""

    @model_validator(mode="before")
    @classmethod
    def _from_preset(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or raw.get("preset") is None:
            return raw
        from trainer.presets import preset_fields

        try:
            fields = preset_fields(raw["preset"])
        except ValueError as e:
            raise ValueError(str(e)) from None
        return {**fields, **raw}

    @model_validator(mode="after")
    def _decoder_or_provider(self) -> "ModelSpec":
        if self.provider is None:
            missing = [name for name in ("n_layers", "d_model", "n_heads") if not getattr(self, name)]
            if missing:
                raise ValueError(f"model needs {', '.join(missing)} (> 0), a preset, or a provider of your own")
            if self.args or self.numbers is not None:
                raise ValueError("model.args and model.numbers go with model.provider (goodput's own decoder takes "
                                 "its fields)")
            return self
        mixed = [name for name in ("preset", "init", "n_layers", "d_model", "n_heads", "ffn_hidden", "n_kv_heads",
                                   "rope_scaling") if getattr(self, name)] + (["tie_embeddings"] if self.tie_embeddings
                                                                               else [])
        if mixed:
            raise ValueError(f"model.provider {self.provider} builds its own model: {', '.join(mixed)} belong to "
                             "goodput's decoder (give the provider its shape in model.args; the data needs "
                             "vocab_size and seq_len)")
        return self


class DatasetSpec(_Strict):
    uri: str
    """Where `goodput tokenize` wrote it (file://PATH or s3://BUCKET/PREFIX)."""
    weight: float = Field(default=1.0, gt=0)


class DataSpec(_Strict):
    kind: Literal["synthetic", "tokens", "shards", "python"] = "synthetic"
    seed: int = 0
    path: str | None = None
    branching: int = Field(default=4, gt=0)
    uri: str | None = None
    """For `shards`: one tokenized dataset (or `datasets`, several mixed by weight)."""
    datasets: list[DatasetSpec] | None = None
    source: str | None = None
    """For `python`: package.module:Name of your data source, installed in the image (never code sent over
    the API); called with seed, seq_len, vocab_size and `args`, its batch(sample_ids) must be a pure
    function of (seed, sample id), which every launch checks."""
    args: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _shards(self) -> "DataSpec":
        if self.kind == "shards" and bool(self.uri) == bool(self.datasets):
            raise ValueError("data.kind = shards needs data.uri (one dataset) or data.datasets (several, "
                             "each {uri, weight}), not both")
        if self.kind != "shards" and (self.uri or self.datasets):
            raise ValueError(f"data.uri and data.datasets are for kind shards, not {self.kind}")
        if (self.kind == "python") != bool(self.source):
            raise ValueError("data.source (package.module:Name) goes with kind python, and kind python needs it")
        if self.args and self.kind != "python":
            raise ValueError("data.args are for kind python")
        return self

    def to_config(self) -> DataConfig:
        sets = [(self.uri, 1.0)] if self.uri else [(d.uri, d.weight) for d in self.datasets or []]
        return DataConfig(kind=self.kind, seed=self.seed, path=self.path, branching=self.branching,
                          datasets=tuple(sets), source=self.source, args=tuple(sorted((self.args or {}).items())))


class TrainSpec(_Strict):
    steps: int = Field(gt=0)
    global_batch: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    lr: float = Field(default=3e-4, gt=0)
    seed: int = 0
    weight_decay: float = Field(default=0.0, ge=0)
    schedule: Schedule = Schedule.ONE_F_ONE_B
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"
    compile: bool = False
    """torch.compile each transformer block (worth it on a GPU; the first steps pay the compilation)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup of the learning rate over this many steps."""
    decay: Literal["none", "cosine", "linear"] = "none"
    """After the warmup, the learning rate decays to lr * min_lr_ratio at the run's last step."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    grad_clip: float = Field(default=0.0, ge=0)
    """Clip the global gradient norm to this (0: off)."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in the backward: every block (`full`) or every other one (`selective`)."""


class ParallelismSpec(_Strict):
    dp: int = Field(default=1, gt=0)
    tp: int = Field(default=1, gt=0)
    pp: int = Field(default=1, gt=0)
    dp_replicas: int = Field(default=1, gt=0)


class LocalClusterSpec(_Strict):
    nodes: int = Field(default=4, gt=0)
    gpus_per_node: int = Field(default=2, gt=0)
    racks: int = Field(default=1, gt=0)
    spares: int = Field(default=0, ge=0)
    gpu_memory_gb: float = Field(default=80.0, gt=0)


class SimulatedClusterSpec(_Strict):
    """`goodput simulate`: a cluster that exists only on a virtual clock."""
    nodes: int = Field(gt=0, le=100_000)
    gpus_per_node: int = Field(default=8, gt=0)
    racks: int = Field(default=1, gt=0)
    spares: int = Field(default=0, ge=0)
    gpu_memory_gb: float = Field(default=80.0, gt=0)


class ClusterSpec(_Strict):
    local: LocalClusterSpec | None = None
    address: str | None = None
    simulated: SimulatedClusterSpec | None = None
    racks: dict[str, str] = Field(default_factory=dict)
    """node -> rack, over what the cluster says (Ray's `rack` label, Kubernetes node labels)"""
    interface: str | None = Field(default=None, pattern=r"^[=^]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")
    """The network interface(s) the ranks' collectives use (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: "eth1",
    or NCCL's forms "ib0,eth1", "^docker"), where the node does not set them itself (a node knows its own
    NICs; a multi-NIC host should). Unset: gloo binds to the address the host's name resolves to, NCCL takes
    the first interface that is not loopback or docker."""

    @field_validator("address")
    @classmethod
    def _address_form(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("ray://") or v == "auto" or ":" in v):
            raise ValueError(f"cluster.address = {v!r}; use ray://HOST:PORT, HOST:PORT or auto")
        return v


class CheckpointSpec(_Strict):
    uri: str = "file://./goodput-runs"
    every_steps: int | Literal["auto"] = 20
    keep: int = Field(default=3, gt=0)
    mtbf_hours: float | None = Field(default=None, gt=0)
    retry_budget_s: float = Field(default=30.0, ge=0)
    """how long a write the store refuses for now (an outage) is retried before the save fails"""
    peer_every_steps: int = Field(default=1, ge=0)
    """peer snapshots: every this many steps each rank's state goes to host memory on its node and on a
    buddy's node; a recovery loads from them instead of the store when every rank's copy survives (0 = off).
    Every step by default (what it costs a step: benchmarks/peer_snapshot_cost.py)."""


class HealthSpec(_Strict):
    straggler_ratio: float = Field(default=1.5, gt=1)
    straggler_steps: int = Field(default=4, ge=1, le=100)
    """steps in a row a rank's score (its last 5 steps' median compute against its stage peers') must
    stay above straggler_ratio before it is flagged, and below half the excess before the flag clears.
    More rides out hosts whose ranks slow down for a few steps at a time (shared cores, a noisy
    neighbour): a rank flagged there is one that stays slow"""
    straggler_action: Literal["report", "replace"] = "report"
    """report: straggler events only; replace: also move the slow rank's node to a spare at the next
    checkpoint, when a spare exists"""
    sdc_every_steps: int = Field(default=10, ge=0)
    grad_spike_factor: float = Field(default=10.0, gt=1)
    probes: bool = True
    hang_factor: float = Field(default=3.0, gt=1)
    collective_timeout_s: float = Field(default=30.0, gt=0)
    """The timeout hierarchy: collective timeout < hang verdict floor < give-up (elastic.wait_for_capacity_s)."""
    hang_floor_s: float = Field(default=45.0, gt=0)

    @model_validator(mode="after")
    def _hierarchy(self) -> "HealthSpec":
        if self.hang_floor_s <= self.collective_timeout_s:
            raise ValueError(f"health.hang_floor_s = {self.hang_floor_s} must exceed "
                             f"health.collective_timeout_s = {self.collective_timeout_s}")
        return self


class ElasticSpec(_Strict):
    min_dp: int = Field(default=1, gt=0)
    max_failures: int = Field(default=10, ge=0)
    wait_for_capacity_s: float = Field(default=300.0, gt=0)
    failure_domain: Literal["world", "replica"] = "world"
    """What a lost node stops: the whole run (a new attempt on a new mesh), or only the data-parallel
    replicas (parallelism.dp_replicas > 1) it held, while the others keep training and the lost ones
    are formed again on spares and rejoin (trainer/replica.py, DESIGN.md "Failure domains")."""
    batch_while_healing: Literal["keep", "shrink"] = "keep"
    """While a replica is out: the survivors take its samples (the global batch is kept, steps take
    longer), or the batch shrinks by its share (steps as fast; its samples are skipped and counted)."""


class DrillSpec(_Strict):
    kind: DrillKind
    at_step: int = Field(ge=0)
    target: str | None = None
    factor: float | None = Field(default=None, ge=1)
    seconds: float | None = Field(default=None, gt=0)
    delay_ms: float | None = Field(default=None, gt=0)
    loss: float | None = Field(default=None, gt=0, le=100)
    point: str | None = None

    @field_validator("target", mode="before")
    @classmethod
    def _rank_as_int(cls, v: Any) -> Any:
        """`target: 2` in YAML is rank 2: a rank may be an int or a string."""
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _params_fit_kind(self) -> "DrillSpec":
        if (problem := params_problem(self.kind, factor=self.factor, seconds=self.seconds, delay_ms=self.delay_ms,
                                      loss=self.loss, point=self.point)) is not None:
            raise ValueError(problem)
        return self


class ComponentRates(_Strict):
    """Unexpected interruptions per component, per 1,000 node-days, and hours to repair a node."""
    gpu: float = Field(default=0.0, ge=0)
    host: float = Field(default=0.0, ge=0)
    network: float = Field(default=0.0, ge=0)
    storage: float = Field(default=0.0, ge=0)
    software: float = Field(default=0.0, ge=0)


class FailureModelSpec(_Strict):
    """`goodput simulate`'s failure model. Default: the Llama 3 405B report (controller.sim.model)."""
    rates: ComponentRates | None = None
    """Per 1,000 node-days; None: the Llama-3-like default."""
    sdc_share: float = Field(default=6 / 268, ge=0, le=1)
    """Of GPU interruptions, the share that is silent data corruption (caught by the probes)."""
    straggler_share: float = Field(default=0.0, ge=0, le=1)
    """Of GPU interruptions, the share that slows the node down instead of stopping it."""
    straggler_factor: float = Field(default=1.5, gt=1)
    repair_hours: ComponentRates = ComponentRates(gpu=24.0, host=8.0, network=0.0, storage=0.0, software=0.0)
    """Hours until a failed node is back (0: it is not taken out)."""


class CostModelSpec(_Strict):
    """`goodput simulate`'s cost model: None takes the default (controller.sim.model.CostModel)."""
    step_s: float | None = Field(default=None, gt=0)
    checkpoint_stall_s: float | None = Field(default=None, ge=0)
    checkpoint_save_s: float | None = Field(default=None, ge=0)
    restore_s: float | None = Field(default=None, ge=0)
    restart_s: float | None = Field(default=None, ge=0)
    node_loss_detection_s: float | None = Field(default=None, ge=0)
    gpu_tflops: float | None = Field(default=None, gt=0)
    peer_snapshot_stall_s: float | None = Field(default=None, ge=0)
    """Peer snapshots (checkpoint.peer_every_steps): the loop's stall per snapshot."""
    peer_transfer_s: float | None = Field(default=None, ge=0)
    """Peer snapshots: the copy to the buddy (in the background; a failure before it completes finds the
    previous step's copies torn)."""
    peer_restore_s: float | None = Field(default=None, ge=0)
    """Peer snapshots: a restore from the peers' memory."""
    replica_stall_s: float | None = Field(default=None, ge=0)
    """elastic.failure_domain replica: the survivors' whole stall per failure, in place of detection + a
    cross-replica init (180: FT-HSDP's ~3 minutes at ~100K GPUs, a pessimistic preset)"""


PRIORITY_CLASSES = {"low": 0, "normal": 100, "high": 200, "critical": 300}
"""A run's priority class (`priority:` in its spec) and its rank in a service's queue: a higher class is
admitted first (controller/service/scheduler.py)."""


class RunSpec(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    priority: str = Field(default="normal", description=f"priority class: {', '.join(PRIORITY_CLASSES)}")
    model: ModelSpec
    data: DataSpec = DataSpec()
    train: TrainSpec
    parallelism: ParallelismSpec | Literal["auto"] = ParallelismSpec()
    cluster: ClusterSpec = ClusterSpec(local=LocalClusterSpec())
    checkpoint: CheckpointSpec = CheckpointSpec()
    health: HealthSpec = HealthSpec()
    elastic: ElasticSpec = ElasticSpec()
    drills: list[DrillSpec] = []
    failures: FailureModelSpec | None = None
    """`goodput simulate` only."""
    cost: CostModelSpec = CostModelSpec()
    """`goodput simulate` only."""

    @field_validator("priority")
    @classmethod
    def _known_priority(cls, value: str) -> str:
        if value not in PRIORITY_CLASSES:
            raise ValueError(f"priority class {value!r} does not exist: one of {', '.join(PRIORITY_CLASSES)}")
        return value

    @model_validator(mode="after")
    def _batch_while_healing(self) -> "RunSpec":
        """failure_domain replica keeping the batch: the live replicas split it, at every live count
        the run can reach (trainer/protocol.batch_problem), refused here rather than at the epoch
        switch that first meets such a count."""
        from trainer.protocol import batch_problem

        e, p = self.elastic, self.parallelism
        if e.failure_domain != "replica" or e.batch_while_healing != "keep" or p == "auto" or p.dp_replicas < 2:
            return self
        problem = batch_problem(self.train.global_batch, dp_shard=p.dp // p.dp_replicas,
                                micro_batch=self.train.micro_batch, replicas=p.dp_replicas,
                                max_failures=e.max_failures)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _drills_fit_domain(self) -> "RunSpec":
        """A drill the run's failure domain cannot take (controller/drills.domain_problem)."""
        replicas = 1 if self.parallelism == "auto" else self.parallelism.dp_replicas
        for drill in self.drills:
            if (problem := domain_problem(drill.kind, self.elastic.failure_domain, replicas)) is not None:
                raise ValueError(f"drills: {problem}")
        return self

    @model_validator(mode="after")
    def _timeouts(self) -> "RunSpec":
        """The top of the timeout hierarchy: a hang must be declared before the run gives up waiting for
        capacity (health.collective_timeout_s < health.hang_floor_s is HealthSpec's own check)."""
        if self.elastic.wait_for_capacity_s <= self.health.hang_floor_s:
            raise ValueError(f"elastic.wait_for_capacity_s = {self.elastic.wait_for_capacity_s:g} must exceed "
                             f"health.hang_floor_s = {self.health.hang_floor_s:g} (a hang is declared before the run "
                             "gives up waiting for capacity); raise the first or lower the second")
        return self

    def to_model_config(self) -> ModelConfig:
        fields = self.model.model_dump(exclude={"preset", "init", "args"})
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"]) if fields["rope_scaling"] else None
        fields["numbers"] = ModelNumbers(**fields["numbers"]) if fields["numbers"] else None
        fields["provider_args"] = tuple(sorted(self.model.args.items()))
        return ModelConfig(**fields)

    def to_train_config(self) -> TrainConfig:
        return TrainConfig(**self.train.model_dump(), init_hf=self.model.init.hf if self.model.init else None)

    def trainer_config(self, mesh: MeshShape) -> TrainerConfig:
        """The trainer's config for an attempt on `mesh`; raises SpecError naming the numbers."""
        config = TrainerConfig(
            model=self.to_model_config(),
            data=self.data.to_config(),
            train=self.to_train_config(),
            mesh=mesh,
            probes=ProbeConfig(enabled=self.health.probes, sdc_every_steps=self.health.sdc_every_steps,
                               spike_factor=self.health.grad_spike_factor),
        )
        try:
            config.validate()
        except ValueError as e:
            raise SpecError(str(e)) from None
        return config

    def fixed_mesh(self) -> MeshShape | None:
        """The mesh the spec fixes, or None for `parallelism: auto`."""
        if self.parallelism == "auto":
            return None
        p = self.parallelism
        return MeshShape(dp=p.dp, pp=p.pp, tp=p.tp, dp_replicas=p.dp_replicas)

    def topology(self, within_s: float | None = None) -> "Topology":
        """The embedded cluster's topology from `cluster.local` (read from the spec: at once, whatever
        `within_s`, a cluster's wait, says)."""
        from controller.topology import Topology

        local = self.cluster.local or LocalClusterSpec()
        try:
            return Topology.from_local(nodes=local.nodes, gpus_per_node=local.gpus_per_node, racks=local.racks,
                                       spares=local.spares, gpu_memory_gb=local.gpu_memory_gb)
        except ValueError as e:
            raise SpecError(str(e)) from None


def _format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "spec"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key {where!r}")
        else:
            parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_spec(raw: Any) -> RunSpec:
    if not isinstance(raw, dict):
        raise SpecError("a run spec must be a mapping with at least name, model and train")
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"invalid run spec: {_format_validation_error(e)}") from None


def load_spec(path: str | Path) -> RunSpec:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(f"cannot read spec {path}: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"spec {path} is not valid YAML: {e}") from None
    return parse_spec(raw)


def checkpoint_store(spec: RunSpec, *, probe: bool = True) -> ObjectStore:
    """The spec's checkpoint store (a local path made absolute: actors do not share our cwd), proven
    writable by a probe object unless told not to (the service probes on its own, with a deadline)."""
    uri = spec.checkpoint.uri
    try:
        store = open_store(uri)
    except StoreError as e:
        raise SpecError(f"checkpoint.uri {uri!r}: {e}") from None
    if probe:
        probe_store(store, uri)
    return store


def probe_store(store: ObjectStore, uri: str) -> None:
    """Write and delete a probe object; SpecError says why the store cannot be written."""
    try:
        key = f".goodput-write-test-{time.time_ns()}"
        store.put_bytes(key, b"ok")
        store.delete_prefix(key)
    except StoreError as e:
        raise SpecError(f"checkpoint.uri {uri!r} cannot be written: {e}") from None
    except OSError as e:
        raise SpecError(f"checkpoint.uri {uri!r} cannot be written: {e.strerror}") from None
