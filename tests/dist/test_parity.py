"""Loss and gradients of one trainer step on a mesh equal a single-process float64 run of the same
model on the same global batch."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.parity import one_step_grads, reference_grads, reference_training, train_steps
from trainer.config import (
    DataConfig, MeshShape, ModelConfig, Schedule, TrainConfig, TrainerConfig, config_to_dict,
)

pytestmark = pytest.mark.dist

TOL = 1e-10


def make_config(dp: int, pp: int, tp: int, schedule: Schedule = Schedule.ONE_F_ONE_B,
                replicas: int = 1) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        data=DataConfig(seed=1),
        train=TrainConfig(steps=1, global_batch=8, micro_batch=1, dtype="float64", schedule=schedule, seed=3),
        mesh=MeshShape(dp=dp, pp=pp, tp=tp, dp_replicas=replicas),
    )


def _norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.nn.utils.get_total_norm(list(grads.values()), 2.0))


def assert_same_grads(results: list[dict], ref_grads: dict[str, torch.Tensor]) -> None:
    """Every rank's global gradient norm, and the full gradients the ranks hold together, equal the
    reference's (TOL)."""
    assert all(abs(r["grad_norm"] - _norm(ref_grads)) < TOL for r in results), "the global gradient norm"
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        grads.update(r["grads"])
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert (grads[name] - ref).abs().max().item() < TOL, name


def assert_same_params(per_rank: list[dict[str, torch.Tensor]], ref_params: dict[str, torch.Tensor],
                       tol: float = TOL) -> None:
    """The parameters the ranks hold together are the reference's, each to `tol`."""
    assert set().union(*per_rank) == set(ref_params)
    for params in per_rank:
        for name, value in params.items():
            err = (value - ref_params[name]).abs().max().item()
            assert err < tol, f"{name} differs by {err}"


@pytest.mark.parametrize("mesh", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)],
                         ids=lambda m: "dp%d-pp%d-tp%d" % m)
def test_one_step_matches_float64_single_process(mesh: tuple[int, int, int]) -> None:
    dp, pp, tp = mesh
    schedules = list(Schedule) if pp > 1 else [Schedule.ONE_F_ONE_B]
    configs = [make_config(dp, pp, tp, s) for s in schedules]
    per_rank = run_ranks(one_step_grads, dp * pp * tp, configs=[config_to_dict(c) for c in configs])
    ref_loss, ref_grads = reference_grads(configs[0])
    for i, schedule in enumerate(schedules):
        results = [rank_results[i] for rank_results in per_rank]
        losses = [r["loss"] for r in results if r["loss"] is not None]
        assert len(losses) == dp * tp, f"{schedule}: expected a loss from each last-stage rank"
        for loss in losses:
            assert abs(loss - ref_loss) < TOL, f"{schedule}: loss {loss} vs reference {ref_loss}"
        assert all(abs(r["grad_norm"] - _norm(ref_grads)) < TOL for r in results), "the global gradient norm"
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            grads.update(r["grads"])
        assert set(grads) == set(ref_grads), f"{schedule}: parameters differ: {set(grads) ^ set(ref_grads)}"
        for name, ref in ref_grads.items():
            err = (grads[name] - ref).abs().max().item()
            assert err < TOL, f"{schedule}: grad of {name} differs by {err}"


def test_hsdp_matches_float64_single_process() -> None:
    """dp = 2 replicas x 2 shards (HSDP) with tp2: world 8, same reference."""
    config = make_config(4, 1, 2, replicas=2)
    results = [r[0] for r in run_ranks(one_step_grads, 8, configs=[config_to_dict(config)])]
    ref_loss, ref_grads = reference_grads(config)
    assert all(abs(r["loss"] - ref_loss) < TOL for r in results)
    assert_same_grads(results, ref_grads)


def test_a_grouped_query_llama3_shape_matches_float64_single_process_on_a_3d_mesh() -> None:
    """The llama3-tiny preset's architecture (2 key/value heads for 4 query heads, RoPE base 500,000
    with Llama 3.1's scaling) on dp2 x pp2 x tp2: each tp rank holds one key/value head."""
    from trainer.config import model_from_dict
    from trainer.presets import preset_fields

    model = model_from_dict({**preset_fields("llama3-tiny"), "n_layers": 4, "vocab_size": 64, "seq_len": 16})
    config = TrainerConfig(model=model, data=DataConfig(seed=1),
                           train=TrainConfig(steps=1, global_batch=8, micro_batch=1, dtype="float64", seed=3),
                           mesh=MeshShape(dp=2, pp=2, tp=2))
    results = [r[0] for r in run_ranks(one_step_grads, 8, configs=[config_to_dict(config)])]
    ref_loss, ref_grads = reference_grads(config)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 4 and all(abs(loss - ref_loss) < TOL for loss in losses), (losses, ref_loss)
    assert ref_grads["layers.0.attention.wk.weight"].shape == (2 * model.head_dim, model.d_model)
    assert_same_grads(results, ref_grads)


def test_tied_embeddings_match_float64_single_process_on_dp_and_tp() -> None:
    """One embedding table that is also the output projection (Llama 3.2's 1B/3B), on dp2 x tp2: its
    gradient sums both uses, as on one process."""
    from trainer.config import model_from_dict
    from trainer.presets import preset_fields

    model = model_from_dict({**preset_fields("llama3-tiny"), "vocab_size": 64, "seq_len": 16,
                             "tie_embeddings": True})
    config = TrainerConfig(model=model, data=DataConfig(seed=1),
                           train=TrainConfig(steps=1, global_batch=8, micro_batch=1, dtype="float64", seed=3),
                           mesh=MeshShape(dp=2, pp=1, tp=2))
    results = [r[0] for r in run_ranks(one_step_grads, 4, configs=[config_to_dict(config)])]
    ref_loss, ref_grads = reference_grads(config)
    assert "output.weight" not in ref_grads
    assert all(abs(r["loss"] - ref_loss) < TOL for r in results), ([r["loss"] for r in results], ref_loss)
    assert_same_grads(results, ref_grads)


def test_warmup_cosine_decay_and_clipping_match_torch_on_one_process() -> None:
    """Four steps on dp2 x pp2 x tp2 with a 2-step warmup, cosine decay to 10%, the gradient clipped
    to a norm below every step's, and every block recomputing its activations: the parameters equal a float64 single process with torch's AdamW,
    its clip_grad_norm_, and the learning rate set by hand from the same schedule."""
    cfg = make_config(2, 2, 2)
    cfg = TrainerConfig(model=cfg.model, data=cfg.data, mesh=cfg.mesh, train=TrainConfig(
        steps=4, global_batch=8, micro_batch=1, dtype="float64", seed=3, lr=1e-2, weight_decay=0.1,
        warmup_steps=2, decay="cosine", min_lr_ratio=0.1, grad_clip=0.05, activation_checkpointing="full"))
    ref_params, norms = reference_training(cfg)
    assert min(norms) > 0.05, f"every step clips: {norms}"
    assert_same_params(run_ranks(train_steps, 8, config=config_to_dict(cfg)), ref_params)
