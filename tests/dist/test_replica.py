"""One data-parallel replica is the failure domain (trainer/replica.py): replicas that train as one
model equal a single float64 process; a replica lost mid-step leaves the other training (the step in
flight discarded, nothing of it applied), and a replica formed again receives the survivor's state
and ends bit-identical to it; replaying the membership log gives the same bytes."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.dist.harness import Ranks
import torch

from tests.dist.parity import reference_training, whole_model
from trainer.data import build_source, local_sample_ids
from tests.dist.replica_ranks import replica_rank, sync_member
from tests.dist.test_parity import assert_same_params
from trainer.config import DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig, config_to_dict
from trainer.replica import Membership, MembershipBoard

pytestmark = pytest.mark.dist

TOL = 1e-10
STEPS = 12


def replica_config(*, dp_shard: int, pp: int, tp: int, steps: int = STEPS, probes: bool = False) -> TrainerConfig:
    """One replica's mesh (its dp is its dp_shard); the run's global batch (split over the live replicas)."""
    return TrainerConfig(
        model=ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
        data=DataConfig(seed=1),
        train=TrainConfig(steps=steps, global_batch=8, micro_batch=1, dtype="float64", seed=3, lr=1e-2,
                          weight_decay=0.1, warmup_steps=2, decay="cosine", min_lr_ratio=0.1, grad_clip=0.05),
        mesh=MeshShape(dp=dp_shard, pp=pp, tp=tp), probes=ProbeConfig(enabled=probes, sdc_every_steps=4),
    )


def whole_run(cfg: TrainerConfig, replicas: int) -> TrainerConfig:
    """The same run as one float64 process sees it (the reference's config)."""
    m = cfg.mesh
    return TrainerConfig(model=cfg.model, data=cfg.data, train=cfg.train,
                         mesh=MeshShape(dp=m.dp * replicas, pp=m.pp, tp=m.tp))


class Controller:
    """The test's side: a store, the membership board, and the replicas' processes."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.board = MembershipBoard(self.store)

    def start(self, cfg: TrainerConfig, replica: int, incarnation: int, epoch: int, *, keep_batch: bool = True) -> Ranks:
        r = cfg.mesh.world_size
        return Ranks(replica_rank, r, port=self.store.port, replica=replica, incarnation=incarnation,
                     config=config_to_dict(cfg), steps=cfg.train.steps, epoch=epoch, keep_batch=keep_batch)

    def progress(self, replica: int) -> int:
        key = f"progress/{replica}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def wait(self, what: str, done: object, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
            time.sleep(0.02)

    def ready(self, replica: int, incarnation: int, ranks: int) -> bool:
        return self.store.check([f"ready/{replica}/{incarnation}/{r}" for r in range(ranks)])


def two_replicas(cfg: TrainerConfig) -> list[list[dict]]:
    """Replicas 0 and 1 trained from epoch 0 with no failure: what each rank of each returned."""
    c = Controller()
    c.board.publish(Membership(0, (0, 1)))
    runs = [c.start(cfg, replica, 0, 0) for replica in (0, 1)]
    return [run.collect(timeout_s=240) for run in runs]


@pytest.mark.parametrize("mesh,probes", [((2, 1, 1), False), ((1, 2, 1), False), ((1, 1, 2), False), ((2, 1, 1), True)],
                         ids=["dp_shard2", "pp2", "tp2", "dp_shard2-probes"])
def test_two_replicas_train_as_one_float64_process_and_hold_the_same_bytes(mesh: tuple[int, int, int],
                                                                            probes: bool) -> None:
    """Two replicas, each its own world of two ranks (FSDP, a pipeline or TP inside), whose gradients
    meet only in one cross-replica group per shard position: after 12 steps (warmup, cosine decay,
    clipping) their parameters equal a float64 single process, and both replicas hold the same
    bytes (parameters and AdamW state). No process group anywhere is larger than max(R, D) = 2. With
    the health probes on, each replica's probes judge its own gradient and the clipping still uses
    the shared one's norm."""
    cfg = replica_config(dp_shard=mesh[0], pp=mesh[1], tp=mesh[2], probes=probes)
    results = two_replicas(cfg)
    ref, _ = reference_training(whole_run(cfg, 2))
    for replica in results:
        assert_same_params([r["params"] for r in replica], ref, TOL)
    assert [r["checksum"] for r in results[0]] == [r["checksum"] for r in results[1]], "the replicas' bytes differ"
    assert max(r["largest_world_group"] for rs in results for r in rs) <= 2
    assert max(r["largest_cross_group"] for rs in results for r in rs) == 2


def test_a_lost_replica_leaves_the_other_training_and_rejoins_with_its_bytes() -> None:
    """dp2 replicas of pp2 (four processes). Replica 1 loses its node (both processes SIGKILLed) after
    its 3rd step: replica 0 discards the step in flight, trains on alone from the controller's next
    epoch with the whole global batch, and stalls no longer than it takes the controller to publish
    it. Replica 1 is formed again (fresh processes, a world of 2, not 4) and receives replica 0's state
    at a step boundary. After 12 steps both replicas hold the same bytes, and the parameters equal a
    float64 single process that never failed (no sample skipped or repeated). Replaying the
    membership log (the same epochs at the same steps, no failure) ends in the same bytes."""
    cfg = replica_config(dp_shard=1, pp=2, tp=1)
    c = Controller()
    c.board.publish(Membership(0, (0, 1)))
    survivor = c.start(cfg, 0, 0, 0)
    lost = c.start(cfg, 1, 0, 0)
    c.wait("replica 1's third step", lambda: c.progress(1) >= 3)
    lost.kill()
    killed_at = time.time()
    c.board.publish(Membership(1, (0,)))  # what the controller does once it has confirmed the node gone
    at_kill = c.progress(0)
    c.wait("replica 0 training alone", lambda: c.progress(0) >= at_kill + 3)
    again = c.start(cfg, 1, 1, 2)
    c.wait("replica 1 formed again", lambda: c.ready(1, 1, cfg.mesh.world_size))
    c.board.publish(Membership(2, (0, 1), joining=(1,)))
    lives = survivor.collect(timeout_s=240)
    rejoined = again.collect(timeout_s=240)

    ref, _ = reference_training(whole_run(cfg, 2))
    assert_same_params([r["params"] for r in lives], ref, TOL)
    assert_same_params([r["params"] for r in rejoined], ref, TOL)
    assert [r["checksum"] for r in lives] == [r["checksum"] for r in rejoined], "the rejoined replica's bytes differ"
    log = lives[0]["log"]
    discarded = [e for e in log if e["kind"] == "discarded"]
    switched = {e["epoch"]: e for e in log if e["kind"] == "switched"}
    assert len(discarded) == 1 and set(switched) == {0, 1, 2}, log
    assert switched[2]["source"] == 0 and rejoined[0]["log"][0]["source"] == 0
    alone = [e for e in log if e["kind"] == "step" and e["epoch"] == 1]
    assert alone and alone[0]["time"] - killed_at < 10.0, "the survivor's first step alone came late"
    assert all(r["largest_world_group"] <= 2 and r["largest_cross_group"] <= 2 for r in lives + rejoined)

    # The same membership log, replayed: epoch 1 from the step the survivor first trained alone, epoch
    # 2 from the step replica 1 rejoined at; replica 1 leaves by the log instead of by a SIGKILL.
    first_alone, rejoin = switched[1]["step"] + 1, switched[2]["step"] + 1
    r = Controller()
    r.board.publish(Membership(0, (0, 1)))
    r.board.publish(Membership(1, (0,), at_step=first_alone))
    r.board.publish(Membership(2, (0, 1), joining=(1,), at_step=rejoin))
    replay0 = r.start(cfg, 0, 0, 0)
    leaves = r.start(cfg, 1, 0, 0)
    replay1 = r.start(cfg, 1, 1, 2)
    left = leaves.collect(timeout_s=240)
    assert all(x["removed"] and x["step"] == first_alone - 1 for x in left), [x["step"] for x in left]
    assert [x["checksum"] for x in replay0.collect(timeout_s=240)] == [x["checksum"] for x in lives]
    assert [x["checksum"] for x in replay1.collect(timeout_s=240)] == [x["checksum"] for x in rejoined]


def reference_skipping(cfg: TrainerConfig, replicas: int, skipped: dict[int, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """reference_training's float64 single process, except that the steps in `skipped` train only
    the samples of the replicas not named there (their share of the global batch, as the replicas
    split it): what shrinking the batch while replicas are out means."""
    t = cfg.train
    provider, model = whole_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    source = build_source(cfg.data, cfg.model)
    dp_total = replicas * cfg.mesh.dp
    for step in range(1, t.steps + 1):
        cursor = (step - 1) * t.global_batch
        ids = list(range(cursor, cursor + t.global_batch))
        if step in skipped:
            ids = sorted(i for k in range(replicas) if k not in skipped[step] for shard in range(cfg.mesh.dp)
                         for i in local_sample_ids(cursor=cursor, global_batch=t.global_batch, dp=dp_total,
                                                   dp_rank=k * cfg.mesh.dp + shard, micro_batch=t.micro_batch))
        rows = torch.from_numpy(source.batch(ids))
        provider.loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        for group in opt.param_groups:
            group["lr"] = t.lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_shrinking_the_batch_while_a_replica_is_out_trains_the_survivors_share_only() -> None:
    """batch_while_healing shrink: replica 0 trains on alone with only its own share of each step's
    samples (replica 1's are skipped), then replica 1 rejoins with its state. The parameters equal a
    float64 single process that trains those steps on replica 0's samples only, and both replicas
    hold the same bytes."""
    cfg = replica_config(dp_shard=1, pp=2, tp=1)
    c = Controller()
    c.board.publish(Membership(0, (0, 1)))
    survivor = c.start(cfg, 0, 0, 0, keep_batch=False)
    lost = c.start(cfg, 1, 0, 0, keep_batch=False)
    c.wait("replica 1's third step", lambda: c.progress(1) >= 3)
    lost.kill()
    c.board.publish(Membership(1, (0,)))
    at_kill = c.progress(0)
    c.wait("replica 0 training alone", lambda: c.progress(0) >= at_kill + 3)
    again = c.start(cfg, 1, 1, 2, keep_batch=False)
    c.wait("replica 1 formed again", lambda: c.ready(1, 1, cfg.mesh.world_size))
    c.board.publish(Membership(2, (0, 1), joining=(1,)))
    lives = survivor.collect(timeout_s=240)
    rejoined = again.collect(timeout_s=240)
    alone = {e["step"] for e in lives[0]["log"] if e["kind"] == "step" and e["epoch"] == 1}
    assert alone, lives[0]["log"]
    ref = reference_skipping(cfg, 2, {step: (1,) for step in alone})
    assert_same_params([r["params"] for r in lives], ref, TOL)
    assert [r["checksum"] for r in lives] == [r["checksum"] for r in rejoined]


def test_a_model_of_the_users_own_trains_as_replicas_like_one_float64_process() -> None:
    """The replica path is the provider contract's too: examples/gpt2_provider.py's model as two
    replicas of tp2 equals the same model on one float64 process, and the replicas hold the same bytes."""
    import dataclasses

    from tests.dist.test_provider import gpt2

    cfg = dataclasses.replace(replica_config(dp_shard=1, pp=1, tp=2, steps=4), model=gpt2())
    results = two_replicas(cfg)
    ref, _ = reference_training(whole_run(cfg, 2))
    for replica in results:
        assert_same_params([r["params"] for r in replica], ref, 1e-9)
    assert [r["checksum"] for r in results[0]] == [r["checksum"] for r in results[1]]


def sync_once(replicas: tuple[int, ...], joining: tuple[int, ...], values: dict[int, float], steps: dict[int, int],
              intact: dict[int, bool] | None = None) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return Ranks(sync_member, len(replicas), port=store.port, replicas=replicas, joining=joining, values=values,
                 steps=steps, intact=intact).collect(timeout_s=120)


def test_a_healing_replica_copies_only_a_state_the_others_vouch_for() -> None:
    """`CrossReplica.sync` gives a joining replica the state of a member the others vouch for: at the
    newest step, intact at rest, and held by the majority of such members. Replica 0 differs from 1
    and 2 at the same step: it is corrupted, not quietly overwritten (issue 44, item 2): it ends as
    the suspect, the others give nothing in that epoch (they wait for the one without it), and in
    that one replica 3 (joining) gets replica 1's state. Two members that differ with no majority,
    or a single member not intact at rest, give nothing: every member ends with
    SilentDataCorruption instead of copying either."""
    got = sync_once((0, 1, 2, 3), (3,), {0: 9.0, 1: 1.0, 2: 1.0, 3: 0.0}, {0: 5, 1: 5, 2: 5})
    assert all("sdc" in g and g["suspects"] == [0] for g in got), got
    assert [g["mine"] for g in got] == [True, False, False, False] and [g["value"] for g in got] == [9.0, 1.0, 1.0, 0.0]
    without = sync_once((1, 2, 3), (3,), {1: 1.0, 2: 1.0, 3: 0.0}, {1: 5, 2: 5})
    assert [g["value"] for g in without] == [1.0] * 3 and {g["source"] for g in without} == {1}, without
    assert {g["step"] for g in without} == {5}
    split = sync_once((0, 1, 2), (2,), {0: 9.0, 1: 1.0}, {0: 5, 1: 5})
    assert all("sdc" in g and "no majority" in g["sdc"] for g in split), split
    flipped = sync_once((0, 1), (1,), {0: 2.0}, {0: 5}, intact={0: False})
    assert all("sdc" in g for g in flipped), flipped
    behind = sync_once((0, 1, 2), (), {0: 3.0, 1: 3.0, 2: 7.0}, {0: 5, 1: 5, 2: 6})
    assert [g["value"] for g in behind] == [7.0] * 3 and {g["step"] for g in behind} == {6}, behind


def test_replicas_that_stop_agreeing_hold_out_the_odd_one_and_heal_it_from_the_vouched_state() -> None:
    """Three replicas of one rank, probes on (each step's agreement compares the parameters at rest).
    After its 5th step replica 2's AdamW state gets one flipped mantissa bit, which no at-rest check of its
    parameters sees; its 6th update then differs. The 7th step's agreement finds replica 2 against
    the majority: nothing of step 7 is applied anywhere, replica 2 ends with SilentDataCorruption and
    names its rank (global rank 2; contained: the others' state is vouched), replicas 0 and 1 discard the step and
    train on from the next epoch; replica 2, formed again, takes the vouched state. All end
    bit-identical and equal to a float64 process that never saw the corruption."""
    import dataclasses

    base = replica_config(dp_shard=1, pp=1, tp=1, probes=True)
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=6))
    c = Controller()
    c.board.publish(Membership(0, (0, 1, 2)))
    runs = [Ranks(replica_rank, 1, port=c.store.port, replica=k, incarnation=0, config=config_to_dict(cfg),
                  steps=cfg.train.steps, epoch=0, replicas=3, corrupt_after=5 if k == 2 else None) for k in (0, 1, 2)]
    odd = runs[2].collect(timeout_s=240)[0]
    assert odd["sdc"] and odd["step"] == 6, odd
    [(kind, detail)] = [e for e in odd["events"] if e[0] == "sdc_suspect"]
    assert detail["contained"] and detail["check"] == "cross_replica" and detail["ranks"] == [2], detail
    assert detail["clean_through_step"] == 5 and detail["replicas"] == [2], detail
    c.board.publish(Membership(1, (0, 1)))
    again = Ranks(replica_rank, 1, port=c.store.port, replica=2, incarnation=1, config=config_to_dict(cfg),
                  steps=cfg.train.steps, epoch=2, replicas=3)
    c.wait("replica 2 formed again", lambda: c.ready(2, 1, 1))
    c.board.publish(Membership(2, (0, 1, 2), joining=(2,)))
    lives = [runs[k].collect(timeout_s=240)[0] for k in (0, 1)]
    healed = again.collect(timeout_s=240)[0]
    for r in lives:
        assert [e["step"] for e in r["log"] if e["kind"] == "discarded"] == [7], r["log"]
    assert healed["log"][0]["source"] == 0 and healed["step"] == cfg.train.steps
    assert len({r["checksum"] for r in [*lives, healed]}) == 1, "the replicas' bytes differ after the heal"
    ref, _ = reference_training(whole_run(cfg, 3))
    assert_same_params([r["params"] for r in [*lives, healed]], ref, TOL)


def test_two_replicas_that_disagree_with_no_evidence_both_stop_and_go_back_to_their_last_agreement() -> None:
    """Two replicas cannot outvote each other: when replica 1's state diverges (a flipped AdamW bit
    after step 5, its 6th update differs) and both compute self-tests pass, neither is trusted. Both end with SilentDataCorruption, and
    replica 0 reports the run clean through the last step they agreed on (no node to quarantine)."""
    cfg = replica_config(dp_shard=1, pp=1, tp=1, probes=True)
    c = Controller()
    c.board.publish(Membership(0, (0, 1)))
    runs = [Ranks(replica_rank, 1, port=c.store.port, replica=k, incarnation=0, config=config_to_dict(cfg),
                  steps=cfg.train.steps, epoch=0, corrupt_after=5 if k == 1 else None) for k in (0, 1)]
    first, second = (run.collect(timeout_s=240)[0] for run in runs)
    assert first["sdc"] and second["sdc"] and first["step"] == second["step"] == 6
    [(_, detail)] = [e for e in first["events"] if e[0] == "sdc_suspect"]
    assert not detail["contained"] and detail["ranks"] == [] and detail["clean_through_step"] == 5, detail
    assert not [e for e in second["events"] if e[0] == "sdc_suspect"]
