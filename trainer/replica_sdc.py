"""The replicas' agreement as a silent-data-corruption detector (failure_domain replica): each step's
agreement carries every replica's state fingerprint at rest (`state_fingerprint`); replicas that
differ with no failure between them hold corrupted state, and `disagreement` decides who is held out
(trainer/replica.py has the groups and the step protocol)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from trainer.replica import FINGERPRINT_MASK, CrossReplica, StepDiscarded, state_tensors


def state_fingerprint(trainer: Any) -> int | None:
    """This rank's state at rest, as the replicas compare it in every step's agreement (the step's
    gradient is not applied anywhere if they differ): the parameters' exact checksum, which the
    probes record after each update anyway; every `probes.sdc_every_steps` steps the whole state
    (parameters and optimizer state). None when nothing is compared at this step (no probes, not a
    whole-state step): every replica decides alike, from the step."""
    from trainer.tensors import bits_checksum

    every = trainer.config.probes.sdc_every_steps
    if every > 0 and trainer.step % every == 0:
        return bits_checksum(state_tensors(trainer.parts, trainer.optimizers)) & FINGERPRINT_MASK
    probes = trainer.probes
    if probes is not None and probes.recorded is not None:
        return probes.recorded & FINGERPRINT_MASK
    return None


def disagreement(trainer: Any, odd: Sequence[float], fingerprints: list[int] | None) -> None:
    """The live replicas' states differ with no failure between them: corruption (the cross-replica
    comparison is an SDC detector). `odd` ([no majority?, then per live replica: suspect?]) is the
    same on every rank of every replica. With a majority, the odd replicas are the suspects; without
    one, each replica's own probes (a compute self-test now) judge which. The suspects' ranks end
    with SilentDataCorruption, and their replica-world rank 0 names the ranks whose shard diverged
    (`contained`: the others' state is vouched, so the controller heals only them); the others
    discard the step (StepDiscarded) and wait for the controller's next epoch. Contained only when
    the states were compared at the step before too (the probes' per-step record): else the
    suspects' gradients since the last comparison reached everyone. When nobody can be judged, or
    nothing is contained, every replica ends with SilentDataCorruption and the run goes back to the
    last step they agreed on. Always raises."""
    from health.sdc import sdc_verdict
    from trainer.probes import SilentDataCorruption

    r: CrossReplica = trainer.replicas
    assert r.membership is not None
    step = trainer.step + 1
    tie = odd[0] > 0
    suspects = {i for i, v in enumerate(odd[1:]) if v > 0}
    if tie and trainer.probes is not None:
        verdict = sdc_verdict(trainer.probes._gather(selftest_now=True, local_anomaly=False))
        try:
            judged = r.judged_by_probes(not verdict.clean) & suspects
        except Exception as e:  # noqa: BLE001 - a peer replica went away meanwhile
            raise StepDiscarded(f"step {step} discarded: the replicas disagree and one failed while judged ({e})") from e
        if judged and len(judged) < r.live:
            suspects, tie = judged, False
    names = sorted(r.membership.replicas[i] for i in suspects)
    offset = getattr(trainer, "rank_offset", 0)
    if tie:  # nobody to trust: every replica stops
        if r.index == 0 and dist.get_rank() == 0 and trainer.sink is not None:
            trainer.sink.event("sdc_suspect", {
                "step": step, "check": "cross_replica", "anomaly": None, "ranks": [], "evidence": {},
                "replicas": names, "contained": False, "clean_through_step": r.agreed_step,
                "why": f"replicas {names} hold different states with no majority and no probe evidence"})
        raise SilentDataCorruption(f"step {step}: replicas {names} hold different states and no majority or probe "
                                   f"tells which is right; back to step {r.agreed_step}, the last they agreed on")
    # The others are clean if the state this step's gradient came from was compared (and agreed) too:
    # else the suspects' gradients since the last agreement reached every replica.
    contained = r.agreed_step >= trainer.step - 1
    if r.index not in suspects:
        if not contained:
            raise SilentDataCorruption(f"step {step}: replica(s) {names} diverged after step {r.agreed_step}, the "
                                       "last compared, and their gradients since reached every replica")
        raise StepDiscarded(f"step {step} discarded: replica(s) {names} hold a state that differs from the "
                            "others' (held out as SDC suspects)")
    here = fingerprints is not None and len(set(fingerprints)) > 1  # this rank's shard diverged
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=r.device)
    flags[dist.get_rank()] = 1 if here else 0
    dist.all_reduce(flags)
    local = [i for i, v in enumerate(flags.tolist()) if v] or list(range(dist.get_world_size()))
    ranks = [offset + i for i in local]
    why = (f"state at rest after step {trainer.step} differs from the majority of {r.live} replicas at its shard "
           "position" if not odd[0] else "its replica's probes failed while the replicas disagreed")
    if dist.get_rank() == 0 and trainer.sink is not None:
        trainer.sink.event("sdc_suspect", {
            "step": step, "check": "cross_replica", "anomaly": None, "ranks": ranks,
            "evidence": {str(rank): [why] for rank in ranks}, "replicas": names, "contained": contained,
            "clean_through_step": r.agreed_step})
    raise SilentDataCorruption(f"step {step}: replica {r.replica}'s state differs from the other replicas' "
                               f"(ranks {ranks}): {why}")
