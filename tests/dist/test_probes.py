"""The probes inside real training steps, without Ray: a flipped bit stops the step before its update
and names the rank; a slowed rank's own compute grows by the factor; clean steps raise nothing and
are bit-identical to steps without probes. Runs on CUDA + NCCL where a GPU is visible, else gloo."""

from __future__ import annotations

import statistics

import pytest

from tests.dist.harness import run_ranks
from trainer.config import DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig, config_to_dict

pytestmark = pytest.mark.dist

# The slow rank computes this many times longer. Well above 2: with more ranks than cores (4 on 2 here,
# more load in CI) the peers fill part of the slow rank's extra time with their own next-step work
# before they block on it; that overlap is at most about one step's compute, so the extra time must be
# several steps' worth for the hold to stand out of it.
SLOW = 4.0


def cfg(mesh: MeshShape, probes: bool = True) -> dict:
    return config_to_dict(TrainerConfig(
        model=ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=64, seq_len=32),
        data=DataConfig(seed=0),
        train=TrainConfig(steps=100, global_batch=8, micro_batch=2, lr=1e-2, dtype="float32"),
        mesh=mesh, probes=ProbeConfig(enabled=probes, sdc_every_steps=3)))


def probe_rank(*, rank: int, world_size: int, store_port: int, config: dict, flip_rank: int) -> dict:
    import torch.distributed as dist

    from trainer.config import config_from_dict
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.probes import SilentDataCorruption
    from trainer.report import ListSink
    from trainer.switches import DrillSwitches
    from trainer.train import Trainer

    c = config_from_dict(config)
    choice = choose_device(c.train.dtype)
    store = dist.PrefixStore("probes", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend=choice.backend, timeout_s=60)
    sink, switches = ListSink(), DrillSwitches()
    trainer = Trainer(c, build_mesh(c.mesh, choice.device.type), choice, sink=sink, switches=switches)
    plain = Trainer(config_from_dict({**config, "probes": {"enabled": False}}), build_mesh(c.mesh, choice.device.type),
                    choice)
    clean = [trainer.train_step() for _ in range(7)]
    reference = [plain.train_step() for _ in range(7)]
    same = all(a.loss == b.loss for a, b in zip(clean, reference))
    # Side by side, so that the machine's own drift falls on both: blocks of two steps at normal pace
    # (A) and blocks of one slowed step and one normal one (B), alternating, each B compared with the A
    # just before it. The slow rank's lateness reaches its peers at the next collective, inside B.
    normal, slowed, held = [], [], []
    for _ in range(6):
        first, second = trainer.train_step(), trainer.train_step()
        normal.append(first.compute_s)
        if rank == flip_rank:  # one slow rank, as a slow GPU is: the others keep their pace
            switches.slow(SLOW)
        late = trainer.train_step()
        switches.slow(1.0)
        after = trainer.train_step()
        slowed.append(late.compute_s)
        held.append(late.step_time_s + after.step_time_s - first.step_time_s - second.step_time_s)
    if rank == flip_rank:
        switches.request_bitflip()
    error = None
    try:
        trainer.train_step()
    except SilentDataCorruption as e:
        error = str(e)
    dist.destroy_process_group()
    return {"device": choice.device.type, "same_as_without_probes": same, "normal": statistics.median(normal),
            "slowed": statistics.median(slowed), "held": statistics.median(held),
            "error": error, "events": sink.events, "step": trainer.step}


@pytest.mark.parametrize("mesh, flip", [(MeshShape(), 0), (MeshShape(dp=2, tp=2), 3),
                                        (MeshShape(dp=2, dp_replicas=2), 1)])
def test_probes_in_real_steps(mesh: MeshShape, flip: int) -> None:
    import torch

    world = mesh.world_size
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs (NCCL allows one rank per GPU)")
    results = run_ranks(probe_rank, world, config=cfg(mesh), flip_rank=flip)
    for rank, r in enumerate(results):
        assert r["same_as_without_probes"], "probes must not change the numbers"
        assert r["error"] is not None and f"ranks [{flip}]" in r["error"], r["error"]
        assert r["step"] == 31, "the corrupted step was not applied"
        flags = [k for k, _ in r["events"] if k in ("sdc_suspect", "sdc_transient", "loss_anomaly")]
        assert flags == (["sdc_suspect"] if rank == 0 else []), "one verdict, from rank 0; none before the flip"
    suspect = dict(results[0]["events"])["sdc_suspect"]
    assert suspect["ranks"] == [flip] and suspect["clean_through_step"] == 31
    assert "at rest" in suspect["evidence"][str(flip)][0]
    flipped = dict(results[flip]["events"])["bitflip_injected"]
    assert abs(flipped["after"]) > 1e30 or abs(flipped["after"]) < 1e-30, flipped
    for rank, r in enumerate(results):
        ratio = r["slowed"] / r["normal"]
        if rank == flip:
            assert 0.8 * SLOW < ratio < SLOW + 0.6, (r["normal"], r["slowed"])
        else:
            assert ratio < 1.4, ("a peer of the slow rank waits, it does not compute longer", ratio)
    # The slowdown is real, not only in the slowed rank's own clock: its peers, held in the step's
    # collectives (the probes' gate all-reduce at the latest), take about as much longer per step as it
    # computes longer, while their own compute stays (what the tracker's relative score rests on).
    extra = results[flip]["slowed"] - results[flip]["normal"]
    for rank, r in enumerate(results):
        if rank != flip:
            assert r["held"] > 0.5 * extra, (f"rank {rank}'s two steps took {r['held']:.4f} s longer while rank "
                                             f"{flip} computed {extra:.4f} s more")


def triage_rank(*, rank: int, world_size: int, store_port: int, config: dict, persistent: bool) -> dict:
    """NaN put into rank 1's gradient shard at step 3: on the first pass only (transient), or on
    every pass from then on (persistent on that rank)."""
    import torch.distributed as dist

    from trainer.config import config_from_dict
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.probes import SilentDataCorruption
    from trainer.tensors import local_tensor
    from trainer.report import ListSink
    from trainer.train import Trainer

    c = config_from_dict(config)
    choice = choose_device(c.train.dtype)
    store = dist.PrefixStore("triage", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend=choice.backend, timeout_s=60)
    sink = ListSink()
    trainer = Trainer(c, build_mesh(c.mesh, choice.device.type), choice, sink=sink)
    plain = Trainer(config_from_dict({**config, "probes": {"enabled": False}}), build_mesh(c.mesh, choice.device.type),
                    choice)
    original, passes = trainer.forward_backward, []

    def poisoned(inputs, targets):  # type: ignore[no-untyped-def]
        loss = original(inputs, targets)
        passes.append(trainer.step + 1)
        first_pass_of_step_3 = passes.count(3) == 1 and trainer.step + 1 == 3
        if rank == 1 and (first_pass_of_step_3 or (persistent and trainer.step + 1 >= 3)):
            grad = next(p.grad for p in trainer.parts[0].parameters() if p.grad is not None)
            local_tensor(grad).view(-1)[0] = float("nan")
        return loss

    trainer.forward_backward = poisoned  # type: ignore[method-assign]
    losses, reference, error = [], [], None
    try:
        for _ in range(6):
            losses.append(trainer.train_step().loss)
            reference.append(plain.train_step().loss)
    except SilentDataCorruption as e:
        error = str(e)
    dist.destroy_process_group()
    return {"losses": losses, "reference": reference, "error": error, "events": sink.events, "passes": passes}


@pytest.mark.parametrize("persistent", [False, True])
def test_anomaly_triage_by_rerunning_the_step(persistent: bool) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("2 ranks need 2 GPUs (NCCL allows one rank per GPU)")
    results = run_ranks(triage_rank, 2, config=cfg(MeshShape(dp=2)), persistent=persistent)
    events = dict(results[0]["events"])
    assert results[0]["passes"].count(3) == 2, "step 3 was re-run from the same inputs"
    if not persistent:
        assert "sdc_transient" in events and "nan" in events["sdc_transient"]["anomaly"]
        for r in results:
            assert r["error"] is None
            assert r["losses"] == r["reference"], "the re-run's result was used: as if nothing happened"
    else:
        suspect = events["sdc_suspect"]
        assert suspect["ranks"] == [1] and "this rank only" in suspect["evidence"]["1"][0]
        assert all(r["error"] is not None for r in results) and len(results[0]["losses"]) == 2
