"""A training process that trains a second attempt in place (its first one failed under it, it tore
its process group down and stayed: controller/ray/rank_actor.py) trains it exactly as a fresh process
would: bit-identical to an uninterrupted run, whether it comes back as the same rank (its warm DTensor
caches kept) or as another one (they must go: their meshes name the old attempt's process groups)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_to_dict

pytestmark = pytest.mark.dist

CONFIG = TrainerConfig(model=ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
                       data=DataConfig(seed=5),
                       train=TrainConfig(steps=3, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32"),
                       mesh=MeshShape(dp=2, pp=2, tp=2))


def attempts(*, rank: int, world_size: int, store_port: int, config: dict, moves: list[int]) -> dict:
    """Attempt k of this process trains as rank (rank + moves[k]) % world from the seeded init; every attempt
    but the last stops after its first step (by raising, as a peer's death would make it), and the
    process goes on to the next in place."""
    import dataclasses

    from tests.dist.reshard import full_state
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    out: dict = {"left": 0}
    last = len(moves) - 1

    class PeerGone(RuntimeError):
        pass

    for k, shift in enumerate(moves):
        as_rank = (rank + shift) % world_size

        def hook(trainer, report, k=k) -> None:  # type: ignore[no-untyped-def]
            if k < last:
                raise PeerGone("a peer died")  # every rank, after the step: no collective left hanging
            if trainer.step == cfg.train.steps:
                out["state"] = full_state(trainer)

        def leave() -> None:
            out["left"] += 1

        args = WorkerArgs(rank=as_rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port,
                          store_prefix=f"attempt-{k}", config=cfg, attempt=k, run_id="in-place")
        try:
            run_worker(dataclasses.replace(args, in_place=k > 0), ListSink(), hook, on_leave=leave)
        except PeerGone:
            continue
    out["rank"] = (rank + moves[-1]) % world_size
    return out


@pytest.mark.parametrize("moves", [[0, 0], [0, 3]], ids=["same-rank", "another-rank"])
def test_a_process_kept_in_place_trains_as_a_fresh_one(moves: list[int]) -> None:
    from trainer.parallel import can_train_again_in_place

    assert can_train_again_in_place(), "this torch cannot drop DTensor's caches: no process would stay"
    config = config_to_dict(CONFIG)
    fresh = run_ranks(attempts, 8, config=config, moves=[0])
    kept = run_ranks(attempts, 8, config=config, moves=moves)
    by_rank = {r["rank"]: r for r in kept}
    for reference in fresh:
        again = by_rank[reference["rank"]]
        assert again["left"] == len(moves) - 1  # on_leave ran once per attempt that failed here
        assert set(again["state"]) == set(reference["state"])
        for name, value in reference["state"].items():
            assert torch.equal(value, again["state"][name]), f"{name} differs after an attempt trained in place"
