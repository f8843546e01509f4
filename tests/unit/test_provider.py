"""The model provider contract (trainer/provider.py) at its edges: a provider's numbers are its
module's, its stages hold global names that add up to the whole model, the planner plans with its
numbers, and each way of getting a provider wrong is refused with what to fix: in the spec, at the
service's door, and on the ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from controller.errors import ServiceError
from controller.planner import PlanError, plan_mesh, static_state_bytes
from controller.providers import with_model_numbers
from controller.service.intake import parse_limited
from controller.spec import SpecError, parse_spec
from controller.topology import Topology
from trainer.config import MeshShape, ModelConfig, TrainConfig
from trainer.provider import Decoder, ask_numbers, load_provider

ROOT = Path(__file__).resolve().parents[2]
PROVIDER = "examples.gpt2_provider:build"


def raw_spec(model: dict) -> dict:
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    return {**raw, "model": model}


def gpt2(**args: int) -> ModelConfig:
    return ModelConfig(n_layers=0, d_model=0, n_heads=0, vocab_size=300, seq_len=32, provider=PROVIDER,
                       provider_args=tuple(sorted(args.items())))


def test_the_numbers_are_the_modules_and_the_stages_add_up_to_the_whole_model() -> None:
    model = gpt2(n_layers=5, d_model=48, n_heads=6)
    provider = load_provider(model)
    numbers = ask_numbers(model)
    with torch.device("meta"):
        whole = dict(provider.build_stage(range(5), first=True, last=True).named_parameters())
        stages = [dict(provider.build_stage(r, first=i == 0, last=i == 2).named_parameters())
                  for i, r in enumerate((range(0, 2), range(2, 4), range(4, 5)))]
    assert numbers.parameters == sum(p.numel() for p in whole.values())
    assert (numbers.n_layers, numbers.tp_width) == (5, 6)
    assert sum(len(s) for s in stages) == len(whole) and set().union(*stages) == set(whole), "global names"
    assert all(whole[name].shape == p.shape for s in stages for name, p in s.items())


def test_goodputs_decoder_is_a_provider_whose_numbers_the_planner_already_uses() -> None:
    model = ModelConfig(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=100, seq_len=16)
    provider = Decoder(model)
    numbers = provider.numbers()
    with torch.device("meta"):
        whole = provider.build_stage(range(3), first=True, last=True)
    assert numbers.parameters == sum(p.numel() for p in whole.parameters()) == model.num_params()
    assert numbers.n_layers == 3 and numbers.tp_width == 2


def test_a_spec_names_a_provider_and_the_controller_asks_it_for_its_numbers() -> None:
    spec = parse_spec(raw_spec({"provider": PROVIDER, "args": {"n_layers": 4, "d_model": 64, "n_heads": 4},
                                "vocab_size": 300, "seq_len": 32}))
    assert spec.model.numbers is None  # parsing never imports a user's model (the CLI parses too)
    with pytest.raises(ValueError, match="not asked of it before planning"):
        spec.to_model_config().num_params()
    resolved = with_model_numbers(spec)
    model = resolved.to_model_config()
    assert model.num_params() == ask_numbers(gpt2(n_layers=4, d_model=64, n_heads=4)).parameters
    assert model.provider_args == (("d_model", 64), ("n_heads", 4), ("n_layers", 4))
    # The planner plans with them: tp must divide the provider's width, pp the layers it has.
    topology = Topology.from_local(nodes=4, gpus_per_node=8, racks=2, spares=0, gpu_memory_gb=80.0)
    plan = plan_mesh(model, TrainConfig(steps=1, global_batch=32, micro_batch=1), topology)
    assert plan.mesh == MeshShape(dp=32, pp=1, tp=1)
    assert plan.static_bytes_per_gpu == static_state_bytes(model.num_params()) // 32
    assert plan.activation_bytes_per_gpu == 4 * 34 * 64 * 32  # layers x its bytes per token x tokens
    odd = with_model_numbers(parse_spec(raw_spec({"provider": PROVIDER, "args": {"n_heads": 3, "d_model": 48},
                                                  "vocab_size": 300, "seq_len": 32})))
    with pytest.raises(SpecError, match=r"tp = 2 does not divide its tensor-parallel width 3"):
        odd.trainer_config(odd.fixed_mesh())  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="tp width 3"):
        plan_mesh(odd.to_model_config(), TrainConfig(steps=1, global_batch=7, micro_batch=2),
                  Topology.from_local(nodes=1, gpus_per_node=2, racks=1, spares=0, gpu_memory_gb=80.0))


@pytest.mark.parametrize("model, error", [
    ({"provider": PROVIDER, "n_layers": 4, "vocab_size": 300, "seq_len": 32}, "n_layers belong to goodput's decoder"),
    ({"provider": PROVIDER, "preset": "llama3-tiny"}, "preset"),
    ({"provider": "examples/gpt2_provider.py", "vocab_size": 300, "seq_len": 32}, "provider"),
    ({"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16, "args": {"x": 1}},
     "model.args and model.numbers go with model.provider"),
    ({"vocab_size": 64, "seq_len": 16}, "model needs n_layers, d_model, n_heads"),
])
def test_a_spec_that_mixes_a_provider_with_the_decoders_fields_is_refused(model: dict, error: str) -> None:
    with pytest.raises(SpecError, match=error):
        parse_spec(raw_spec(model))


@pytest.mark.parametrize("provider, args, error", [
    ("no_such_package.models:build", {}, r"cannot import no_such_package.models .* installed in the image"),
    ("tests.support.providers:missing", {}, "has no function missing"),
    ("tests.support.providers:NOT_A_FUNCTION", {}, "has no function NOT_A_FUNCTION"),
    (PROVIDER, {"layers": 4}, r"does not take these arguments .*\['layers'\]"),
    ("tests.support.providers:no_loss", {}, "without loss"),
    ("tests.support.providers:bad_numbers", {}, "not trainer.config.ModelNumbers"),
])
def test_a_provider_that_cannot_be_had_is_refused_at_the_services_door(provider: str, args: dict, error: str) -> None:
    from controller.service.registry import Registry
    from controller.service.service import Service
    from tests.unit.fakes import FakeCluster, FakeWorkerGroup

    spec = parse_limited(raw_spec({"provider": provider, "args": args, "vocab_size": 300, "seq_len": 32}))
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: FakeWorkerGroup(),
                      threads=False)
    with pytest.raises(ServiceError, match=error) as refused:
        service.add(spec)
    assert refused.value.code == "invalid_spec" and not service.runs()


def test_a_rank_refuses_a_stage_its_provider_left_without_fsdp() -> None:
    """parallelize() must shard the stage root: goodput's loop (gradient sync, the snapshots) needs it."""
    from trainer.config import DataConfig, MeshShape, TrainerConfig
    from trainer.parallel import build_model_parts, choose_device

    class Lazy:
        def __init__(self) -> None:
            self.inner = load_provider(gpt2(n_layers=2))

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self.inner, name)

        def parallelize(self, part, plan) -> None:  # type: ignore[no-untyped-def]
            pass

    model = dataclasses.replace(gpt2(n_layers=2), numbers=ask_numbers(gpt2(n_layers=2)))
    config = TrainerConfig(model=model, data=DataConfig(), train=TrainConfig(steps=1, global_batch=1, micro_batch=1),
                           mesh=MeshShape())

    class OneRankMesh:
        def __getitem__(self, axis: str):  # type: ignore[no-untyped-def]
            return self

        def get_local_rank(self) -> int:
            return 0

    with pytest.raises(ValueError, match="without FSDP at its root"):
        build_model_parts(config, OneRankMesh(), choose_device("float32"), Lazy())  # type: ignore[arg-type]


def test_eval_reads_a_providers_model_and_export_says_it_writes_llama_only(tmp_path: Path) -> None:
    import torch.nn.functional as F

    from checkpointing.store import LocalStore
    from trainer.export import export_hf, mean_loss

    model = dataclasses.replace(gpt2(n_layers=2), numbers=ask_numbers(gpt2(n_layers=2)))
    provider = load_provider(model)
    net = provider.build_stage(range(2), first=True, last=True)
    provider.init_weights(net, seed=1)
    windows = torch.randint(0, 300, (5, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = float(F.cross_entropy(net(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()))
    assert abs(mean_loss(model, net.state_dict(), windows, batch=2) - expected) < 1e-5
    with pytest.raises(ValueError, match="Llama folders of goodput's own decoder"):
        export_hf(LocalStore(tmp_path), "mine", model, tmp_path / "hf")


def test_plan_and_simulate_ask_a_provider_and_simulate_charges_its_flops(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`goodput simulate` times a step from the provider's own FLOPs per token (not 6 x parameters);
    `goodput plan` plans with its numbers."""
    import json

    from controller.cli.main import build_parser
    from controller.sim.model import DEFAULT_GPU_TFLOPS

    args = {"n_layers": 4, "d_model": 64, "n_heads": 4}
    spec = {"name": "mine", "model": {"provider": PROVIDER, "args": args, "vocab_size": 300, "seq_len": 32},
            "train": {"steps": 200, "global_batch": 8, "micro_batch": 1},
            "parallelism": {"dp": 2, "tp": 2, "pp": 2},
            "cluster": {"simulated": {"nodes": 4, "gpus_per_node": 2, "racks": 1, "spares": 0}},
            "checkpoint": {"uri": "sim://", "every_steps": 50, "keep": 2}, "failures": {}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(spec))

    def cli(*argv: str) -> dict:
        opts = build_parser().parse_args(list(argv))
        assert opts.func(opts) == 0
        return json.loads(capsys.readouterr().out)

    result = cli("simulate", str(path), "--days", "0.01", "--json")
    numbers = ask_numbers(gpt2(**args))
    assert result["params"] == numbers.parameters
    expected = numbers.flops_per_token * 8 * 32 / (8 * DEFAULT_GPU_TFLOPS * 1e12)
    assert result["cost_model"]["step_s"] == pytest.approx(expected, rel=1e-9)
    assert numbers.flops_per_token > 6 * numbers.parameters, "attention counted: not the 6N default"
    local = {**spec, "cluster": {"local": {"nodes": 4, "gpus_per_node": 2, "racks": 1, "spares": 0}}}
    path.write_text(yaml.safe_dump(local))
    assert cli("plan", str(path), "--json")["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
