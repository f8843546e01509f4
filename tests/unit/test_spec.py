"""Bad specs fail before any process starts, with a message that names the numbers."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.spec import RunSpec, SpecError, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())


def with_changes(**sections: dict) -> dict:
    raw = copy.deepcopy(BASE)
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def training_slots(spec: RunSpec) -> int:
    """GPU slots of the embedded cluster's training nodes (spares held back)."""
    return sum(n.num_gpus for n in spec.topology().usable())


def test_example_spec_is_valid() -> None:
    spec = load_spec(ROOT / "examples" / "tiny-gpt.yaml")
    mesh = spec.fixed_mesh()
    assert mesh is not None and mesh.world_size == training_slots(spec) == 8
    spec.trainer_config(mesh).validate(world_size=8)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"model": {"n_heads": 3, "d_model": 96}}, "n_heads = 3 is not divisible by tp = 2"),
        ({"model": {"n_layers": 1}}, "n_layers = 1 is fewer than the 2 pipeline stages"),
        ({"train": {"schedule": "Interleaved1F1B"}, "model": {"n_layers": 3}},
         "n_layers = 3 is fewer than the 4 pipeline stages"),
        ({"train": {"global_batch": 10}}, "global_batch = 10 is not divisible by dp * micro_batch = 2 * 2 = 4"),
        ({"train": {"global_batch": 4}}, "needs at least pp = 2 micro-batches per step"),
        ({"model": {"d_model": 130}}, "d_model = 130 is not divisible by n_heads = 4"),
    ],
)
def test_bad_trainer_shape_names_the_numbers(changes: dict, expected: str) -> None:
    spec = parse_spec(with_changes(**changes))
    mesh = spec.fixed_mesh()
    assert mesh is not None
    with pytest.raises(SpecError, match=expected.replace("*", r"\*")):
        spec.trainer_config(mesh)


def test_world_size_mismatch_names_the_numbers() -> None:
    spec = parse_spec(with_changes(parallelism={"dp": 1}))
    mesh = spec.fixed_mesh()
    assert mesh is not None
    with pytest.raises(ValueError, match=r"dp\*pp\*tp = 1\*2\*2 = 4 but there are 8 GPU slots"):
        spec.trainer_config(mesh).validate(world_size=training_slots(spec))


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({**BASE, "modle": {}}, "unknown key 'modle'"),
        (with_changes(train={"stpes": 3}), "unknown key 'train.stpes'"),
        (with_changes(train={"steps": 0}), "train.steps: Input should be greater than 0"),
        ({k: v for k, v in BASE.items() if k != "model"}, "model: Field required"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_malformed_spec_is_one_clear_error(raw: object, expected: str) -> None:
    with pytest.raises(SpecError, match=expected):
        parse_spec(raw)


def test_cli_rejects_bad_spec_before_starting_anything(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_changes(model={"n_heads": 3, "d_model": 96})))
    proc = subprocess.run([sys.executable, "-m", "controller", "run", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "n_heads = 3 is not divisible by tp = 2" in lines[0], proc.stderr


@pytest.mark.parametrize("health, elastic, expected", [
    ({"collective_timeout_s": 20, "hang_floor_s": 30}, {"wait_for_capacity_s": 30},
     "elastic.wait_for_capacity_s = 30 must exceed health.hang_floor_s = 30"),
    ({"collective_timeout_s": 30, "hang_floor_s": 30}, {"wait_for_capacity_s": 300},
     "health.hang_floor_s = 30.0 must exceed health.collective_timeout_s = 30.0"),
])
def test_the_whole_timeout_hierarchy_is_checked(health: dict, elastic: dict, expected: str) -> None:
    """collective_timeout_s < hang_floor_s < wait_for_capacity_s, as the README says."""
    with pytest.raises(SpecError, match=re.escape(expected)):
        parse_spec(with_changes(health=health, elastic=elastic))


def test_a_batch_the_live_replicas_cannot_split_is_refused_at_submission() -> None:
    """Issue 44, item 6: failure_domain replica keeping the batch met a live count that does not split
    it only at the epoch switch (the error swallowed, the run stalled, then the world path). Three
    replicas of dp_shard 1 with micro_batch 2 reach 3, 2 and 1 live: global batch 8 does not split
    over 3; 12 does; `shrink` never splits it over fewer."""
    replicas = {"dp": 3, "tp": 1, "pp": 1, "dp_replicas": 3}
    keep = {"failure_domain": "replica", "batch_while_healing": "keep"}
    with pytest.raises(SpecError, match=r"global_batch = 8 does not split over 3 live replica.*multiple of 12"):
        parse_spec(with_changes(parallelism=replicas, elastic=keep, train={"global_batch": 8, "micro_batch": 2}))
    parse_spec(with_changes(parallelism=replicas, elastic=keep, train={"global_batch": 12, "micro_batch": 2}))
    parse_spec(with_changes(parallelism=replicas, elastic={**keep, "max_failures": 0},
                            train={"global_batch": 6, "micro_batch": 2}))  # (no failure: 3 live only)
    parse_spec(with_changes(parallelism=replicas, elastic={**keep, "batch_while_healing": "shrink"},
                            train={"global_batch": 6, "micro_batch": 2}))
