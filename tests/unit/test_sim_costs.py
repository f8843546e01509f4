"""The simulator's cost model, term by term, checked by hand against its sources' figures."""

from __future__ import annotations

import pytest

from controller.sim.model import comm_init_s, cost_model, restart_s, restore_s
from controller.spec import parse_spec


def test_communicator_init_runs_from_the_measured_world_1_to_the_published_16k_figure() -> None:
    assert comm_init_s(1) == pytest.approx(0.36)  # goodput on one H100
    assert comm_init_s(16384) == pytest.approx(150.0)  # NVIDIA/nccl#1156: 2.5 min at large scale
    assert comm_init_s(8193) == pytest.approx((0.36 + 150.0) / 2, rel=1e-3)  # linear between
    assert restart_s(16384) == pytest.approx(0.15 + 150.0)  # CUDA init + communicators


def test_restore_is_bound_by_the_node_link_or_the_store_whichever_is_slower() -> None:
    # 8 GB per GPU, 8 GPUs per node, 64 GB per node over 12.5 GB/s: the node link binds at 16 GPUs
    assert restore_s(16 * 8e9, gpus=16, gpus_per_node=8) == pytest.approx(64e9 / 12.5e9)
    # 6.5 TB over 16,384 GPUs: 3.2 GB per node is 0.25 s, but the store's 2 TB/s takes 3.24 s
    assert restore_s(6.48e12, gpus=16384, gpus_per_node=8) == pytest.approx(6.48e12 / 2e12)


def test_defaults_fill_what_the_spec_leaves_out_and_the_spec_overrides_each() -> None:
    raw = {"name": "c", "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 128, "seq_len": 64},
           "train": {"steps": 10, "global_batch": 8, "micro_batch": 1},
           "cluster": {"simulated": {"nodes": 2, "gpus_per_node": 4, "racks": 1, "spares": 0}},
           "checkpoint": {"uri": "sim://"}}
    spec = parse_spec(raw)
    params = spec.to_model_config().num_params()
    c = cost_model(spec, params=params, gpus=8, gpus_per_node=4)
    # CUDA init 0.15 s + communicator init 0.36 s at world 1, growing by (150 - 0.36) s over 16,383 ranks
    assert c.restart_s == pytest.approx(0.15 + 0.36 + 7 * (150.0 - 0.36) / 16383)
    # A loud node loss from the data plane on the world path too (goodput's measured 0.83 s, charged 1 s),
    # a silent one from the heartbeat: 1 s unmoved, the next poll 0.2 s, the raylet probe's 0.3 s
    assert (c.node_loss_detection_s, c.replica_detection_s, c.silent_detection_s) == pytest.approx((1.0, 1.0, 1.5))
    per_node = 16 * params / 8 * 4  # 16 bytes per parameter, 8 GPUs, 4 per node
    assert c.restore_s == pytest.approx(per_node / 12.5e9)  # a node's 100 Gb/s link binds (not the store's 2 TB/s)
    assert c.step_s == pytest.approx(6 * params * 8 * 64 / (8 * 400e12))
    assert c.checkpoint_save_s == pytest.approx(per_node / 2e9)  # a node's 2 GB/s binds here
    assert c.peer_snapshot_stall_s == pytest.approx(16 * params / 8 / 10e9)  # a GPU's share staged at 10 GB/s
    # To the buddy and back over the same 100 Gb/s node link as the store's restore, not per GPU.
    assert c.peer_transfer_s == pytest.approx(per_node / 12.5e9)
    assert c.peer_restore_s == pytest.approx(per_node / 12.5e9)
    raw["cost"] = {"restart_s": 600.0, "node_loss_detection_s": 1.0, "restore_s": 7.0}
    c = cost_model(parse_spec(raw), params=params, gpus=8, gpus_per_node=4)
    assert (c.restart_s, c.node_loss_detection_s, c.restore_s) == (600.0, 1.0, 7.0)


def test_a_save_at_scale_is_bound_by_the_store() -> None:
    """Llama 3 405B's 6.5 TB from 2,048 nodes at 2 GB/s each would be 4 TB/s: the store takes 2."""
    raw = {"name": "c", "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 128, "seq_len": 64},
           "train": {"steps": 10, "global_batch": 8, "micro_batch": 1},
           "cluster": {"simulated": {"nodes": 2, "gpus_per_node": 4, "racks": 1, "spares": 0}},
           "checkpoint": {"uri": "sim://"}}
    c = cost_model(parse_spec(raw), params=405_000_000_000, gpus=16384, gpus_per_node=8)
    assert c.checkpoint_save_s == pytest.approx(16 * 405e9 / 2e12)
