"""A stop at a step boundary asked from outside the ranks (trainer/stop.py: what a preemption and a
drain use), through the real worker entry point on 4 gloo ranks (dp2 x pp2): every rank stops after the
same step with nothing in flight; `store` commits that step before the ranks leave and the run resumed
from it ends bit-identical to a run never stopped (0 steps redone); `peers` trains on to its next
snapshot step and writes nothing to the store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpointing.manifest import committed_steps
from checkpointing.store import LocalStore
from tests.dist.harness import run_ranks
from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_to_dict

pytestmark = pytest.mark.dist


def runs(*, rank: int, world_size: int, store_port: int, config: dict, root: str, keep: str) -> dict:
    import torch.distributed as dist

    from tests.dist.parity import full
    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.stop import Keep, request_stop
    from trainer.worker import WorkerArgs, run_worker

    cfg = config_from_dict(config)
    out: dict = {}

    def grab(key: str):  # type: ignore[no-untyped-def]
        def hook(trainer, report) -> None:  # type: ignore[no-untyped-def]
            if trainer.step == trainer.config.train.steps:
                out[key] = {n: full(p).detach().clone() for part in trainer.parts for n, p in part.named_parameters()}
        return hook

    def ask_at_3(trainer, report) -> None:  # type: ignore[no-untyped-def]
        if rank == 0 and trainer.step == 3:  # the controller's request, as the store carries it
            client = dist.PrefixStore("b", dist.TCPStore("127.0.0.1", store_port, is_master=False))
            request_stop(client, Keep[keep.upper()], "preempted by a test")

    common = dict(rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=store_port, config=cfg,
                  checkpoint_uri=f"file://{root}/ckpt", checkpoint_keep=5, staging_dir=f"{root}/staging",
                  peer_every=2, peer_dir=f"{root}/peers/node-{rank}")
    run_worker(WorkerArgs(store_prefix="a", run_id="straight", **common), ListSink(), grab("straight"))  # type: ignore[arg-type]
    sink = ListSink()
    summary = run_worker(WorkerArgs(store_prefix="b", run_id="stopped", stoppable=True, **common),  # type: ignore[arg-type]
                         sink, ask_at_3)
    out["stopped"] = (summary.step, summary.stopped)
    out["events"] = sink.events
    if keep == "store":
        run_worker(WorkerArgs(store_prefix="c", run_id="stopped", attempt=1, resume_step=summary.step,  # type: ignore[arg-type]
                              **{**common, "peer_every": 0}), ListSink(), grab("resumed"))
    return out


@pytest.mark.parametrize("keep", ["store", "peers"])
def test_every_rank_stops_after_the_same_step_with_its_state_kept(tmp_path: Path, keep: str) -> None:
    cfg = TrainerConfig(
        model=ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        data=DataConfig(seed=4),
        train=TrainConfig(steps=6, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32"),
        mesh=MeshShape(dp=2, pp=2, tp=1),
    )
    results = run_ranks(runs, 4, config=config_to_dict(cfg), root=str(tmp_path), keep=keep)
    at = 3 if keep == "store" else 4  # peers: on to the next snapshot step (every 2)
    assert [r["stopped"] for r in results] == [(at, keep)] * 4, "every rank after the same step"
    stopped = [d for kind, d in results[0]["events"] if kind == "stopped_at_boundary"]
    assert stopped == [{"step": at, "kept": keep, "reason": "preempted by a test", "agreed_step": 3}], \
        "agreed after the step it was asked in"
    store = LocalStore(tmp_path / "ckpt")
    if keep == "store":
        assert committed_steps(store, "stopped") == [3], "the stopped step committed before the ranks left"
        for r in results:
            for name, value in r["straight"].items():
                assert torch.equal(value, r["resumed"][name]), f"{name} differs after the stop and resume"
    else:
        assert committed_steps(store, "stopped") == [], "nothing written to the store"
        assert list((tmp_path / "peers").rglob("*a0-r*.own*")), "the snapshot of the step is on the nodes"


def sigterm(*, rank: int, world_size: int, store_port: int, config: dict, root: str) -> dict:
    import os
    import signal

    from trainer.config import config_from_dict
    from trainer.report import ListSink
    from trainer.worker import WorkerArgs, run_worker

    def reclaimed_at_3(trainer, report) -> None:  # type: ignore[no-untyped-def]
        if rank == 2 and trainer.step == 3:  # its VM is reclaimed: a SIGTERM, then a grace period
            os.kill(os.getpid(), signal.SIGTERM)

    sink = ListSink()
    before = signal.getsignal(signal.SIGTERM)
    summary = run_worker(WorkerArgs(rank=rank, world_size=world_size, store_host="127.0.0.1",  # type: ignore[arg-type]
                                    store_port=store_port, config=config_from_dict(config), store_prefix="s",
                                    run_id="spot", checkpoint_uri=f"file://{root}/ckpt", checkpoint_keep=5,
                                    staging_dir=f"{root}/staging", peer_every=2, peer_dir=f"{root}/peers/node-{rank}",
                                    stoppable=True), sink, reclaimed_at_3)
    return {"stopped": (summary.step, summary.stopped), "events": sink.events,
            "handler_back": signal.getsignal(signal.SIGTERM) == before}


def test_a_sigterm_on_one_rank_stops_every_rank_at_the_next_snapshot_step_and_names_it(tmp_path: Path) -> None:
    """A SIGTERM (a spot VM reclaimed, an eviction) does not kill the rank: it is caught, the world agrees
    at the next boundary to stop at its next peer snapshot step (like a drain), the rank says
    `terminating` for the controller to reseat its node's ranks, and SIGTERM is handed back."""
    cfg = TrainerConfig(
        model=ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        data=DataConfig(seed=4),
        train=TrainConfig(steps=8, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32"),
        mesh=MeshShape(dp=2, pp=2, tp=1),
    )
    results = run_ranks(sigterm, 4, config=config_to_dict(cfg), root=str(tmp_path))
    assert [r["stopped"] for r in results] == [(4, "peers")] * 4, "every rank after step 4, kept by its peers"
    assert [kind for kind, _ in results[2]["events"]].count("terminating") == 1
    assert not [kind for r in (results[0], results[1], results[3]) for kind, _ in r["events"] if kind == "terminating"]
    (told,) = [d for kind, d in results[2]["events"] if kind == "terminating"]
    assert (told["step"], told["signal"]) == (3, "SIGTERM")
    assert [d for kind, d in results[0]["events"] if kind == "stopped_at_boundary"] == \
        [{"step": 4, "kept": "peers", "reason": "a rank's SIGTERM", "agreed_step": 3}]
    assert all(r["handler_back"] for r in results)
    assert committed_steps(LocalStore(tmp_path / "ckpt"), "spot") == [], "nothing written to the store"
