"""The learning rate is a pure function of the step: warmup, then constant, cosine or linear decay to
lr * min_lr_ratio at the run's last step. References: the closed forms at chosen steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from controller.spec import SpecError, parse_spec
from trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def _train(**fields: object) -> TrainConfig:
    return TrainConfig(**{"steps": 100, "global_batch": 8, "micro_batch": 1, "lr": 1.0, **fields})  # type: ignore[arg-type]


def test_warmup_rises_linearly_to_the_peak() -> None:
    t = _train(warmup_steps=10)
    assert [t.lr_at(s) for s in (1, 5, 10, 11, 100)] == [0.1, 0.5, 1.0, 1.0, 1.0]


def test_cosine_decay_ends_at_the_floor_on_the_last_step_and_is_halfway_at_mid_span() -> None:
    t = _train(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert t.lr_at(10) == 1.0 and t.lr_at(100) == pytest.approx(0.1)
    assert t.lr_at(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert t.lr_at(250) == pytest.approx(0.1), "a step past the end stays at the floor"
    values = [t.lr_at(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:])), "monotone after the warmup"


def test_linear_decay_and_no_warmup() -> None:
    t = _train(decay="linear")
    assert [t.lr_at(s) for s in (0, 50, 100)] == pytest.approx([1.0, 0.5, 0.0])


def test_the_spec_takes_the_schedule_and_refuses_what_cannot_be() -> None:
    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    train = {**raw["train"], "warmup_steps": 5, "decay": "cosine", "min_lr_ratio": 0.1, "grad_clip": 1.0}
    t = parse_spec({**raw, "train": train}).to_train_config()
    assert (t.warmup_steps, t.decay, t.min_lr_ratio, t.grad_clip) == (5, "cosine", 0.1, 1.0)
    for bad in ({"decay": "exponential"}, {"min_lr_ratio": 1.5}, {"grad_clip": -1}, {"warmup_steps": -2}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            parse_spec({**raw, "train": {**raw["train"], **bad}})
