"""A user's own data source (`data.kind: python`): imported by name, called with (seed, seq_len,
vocab_size, args), and held at every launch to being a pure function of the sample id, with the
right shape and ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import yaml

from controller.spec import SpecError, parse_spec
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig
from trainer.data import build_source, check_pure, local_sample_ids

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


def _data(source: str, **args: object) -> DataConfig:
    return DataConfig(kind="python", source=source, args=tuple(sorted(args.items())), seed=3)


def test_a_pure_source_is_built_with_its_args_and_checked() -> None:
    source = build_source(_data("tests.support.sources:Copy", low=5), MODEL)
    check_pure(source, seq_len=16, vocab_size=64)
    rows = source.batch(local_sample_ids(cursor=0, global_batch=8, dp=2, dp_rank=1, micro_batch=2))
    assert rows.shape == (4, 17) and rows.min() >= 5
    assert np.array_equal(rows[:, :8], rows[:, 9:17]), "its second half copies the first"


@pytest.mark.parametrize("source, message", [
    ("tests.support.sources:Stateful", "not a pure function of the sample id"),
    ("tests.support.sources:short", r"has shape \(5, 16\); it must be"),
    ("tests.support.sources:Nope", "cannot be imported here"),
    ("tests.support.sources", "package.module:Name"),
])
def test_a_source_that_breaks_the_rules_is_refused_at_launch(source: str, message: str) -> None:
    from trainer.parallel import build_mesh, choose_device
    from trainer.train import Trainer

    cfg = TrainerConfig(model=MODEL, data=_data(source), mesh=MeshShape(),
                        train=TrainConfig(steps=1, global_batch=4, micro_batch=2, dtype="float32"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=message):
            Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
    finally:
        dist.destroy_process_group()


def test_ids_out_of_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match=r"token ids in \[\d+, \d+\] but model.vocab_size = 10"):
        check_pure(build_source(_data("tests.support.sources:Copy"), MODEL), seq_len=16, vocab_size=10)


def test_the_spec_takes_a_source_and_its_args() -> None:
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    spec = parse_spec({**raw, "data": {"kind": "python", "source": "tests.support.sources:Copy", "args": {"low": 2}}})
    assert spec.data.to_config().args == (("low", 2),)
    with pytest.raises(SpecError, match="goes with kind python"):
        parse_spec({**raw, "data": {"kind": "python"}})
    with pytest.raises(SpecError, match="args are for kind python"):
        parse_spec({**raw, "data": {"kind": "synthetic", "args": {"low": 2}}})


def test_the_synthetic_chain_refuses_a_vocabulary_whose_table_would_not_fit() -> None:
    big = ModelConfig(n_layers=1, d_model=32, n_heads=4, vocab_size=128256, seq_len=16)
    with pytest.raises(ValueError, match="123 GiB.*data.kind shards"):
        build_source(DataConfig(), big)
