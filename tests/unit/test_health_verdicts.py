"""Straggler scoring and SDC verdicts from tables of samples (pure: no torch, no ray)."""

from __future__ import annotations

import random

import pytest

from health.sdc import RankEvidence, Triage, minority, sdc_verdict, step_anomaly, triage
from health.straggler import StragglerConfig, StragglerTracker

# 8 ranks, dp2 x pp2 x tp2 (rank = dp*4 + pp*2 + tp): stage 0 = {0, 1, 4, 5}, stage 1 = {2, 3, 6, 7}
STAGE = {r: (r // 2) % 2 for r in range(8)}
BASE = {0: 0.30, 1: 0.30, 4: 0.30, 5: 0.30, 2: 0.40, 3: 0.40, 6: 0.40, 7: 0.40}


def run(compute: dict[int, list[float]], config: StragglerConfig = StragglerConfig()) -> tuple[list, StragglerTracker]:
    tracker = StragglerTracker(STAGE, config)
    verdicts = []
    steps = len(next(iter(compute.values())))
    for step in range(1, steps + 1):
        for rank in sorted(compute):
            tracker.add(rank, step, compute[rank][step - 1])
        verdicts.extend(tracker.evaluate())
    return verdicts, tracker


def samples(steps: int, *, noise: float = 0.02, seed: int = 0,
            slow: dict[int, tuple[int, float]] | None = None) -> dict[int, list[float]]:
    """Per-rank compute times: BASE with multiplicative noise; slow = {rank: (from_step, factor)}."""
    rng = random.Random(seed)
    out = {}
    for rank, base in BASE.items():
        start, factor = (slow or {}).get(rank, (steps + 1, 1.0))
        out[rank] = [base * (factor if step >= start else 1.0) * (1 + rng.uniform(-noise, noise))
                     for step in range(1, steps + 1)]
    return out


def test_clean_run_flags_nothing() -> None:
    verdicts, tracker = run(samples(200))
    assert verdicts == []
    assert all(0.9 < s.relative < 1.1 and not s.straggler for s in tracker.scores.values())


def test_slow_rank_is_flagged_quickly_and_only_it() -> None:
    verdicts, tracker = run(samples(60, slow={5: (30, 1.7)}))
    assert [(v.rank, v.basis) for v in verdicts] == [(5, "relative")]
    assert 30 <= verdicts[0].step <= 30 + 10, "flagged within ten steps of the slowdown"
    assert verdicts[0].score == pytest.approx(1.7, rel=0.05)
    assert tracker.scores[5].straggler and not any(s.straggler for r, s in tracker.scores.items() if r != 5)


def test_waiters_are_never_blamed() -> None:
    """A slow rank's peers wait long (their step time grows) but compute as before: the scores use
    compute only, so a table where the waiters' compute is unchanged flags the slow rank alone."""
    compute = samples(60, slow={2: (20, 2.0)})
    verdicts, _ = run(compute)
    assert {v.rank for v in verdicts} == {2}


def test_noisy_but_healthy_rank_does_not_flag() -> None:
    """Rank 3 has +-40 % noise and an occasional 3x spike: the window median absorbs it."""
    rng = random.Random(1)
    compute = samples(300)
    compute[3] = [0.40 * (3.0 if rng.random() < 0.1 else 1 + rng.uniform(-0.4, 0.4)) for _ in range(300)]
    verdicts, _ = run(compute)
    assert verdicts == []


def test_rank_hovering_at_the_ratio_does_not_flap() -> None:
    """Alternating just above and below the ratio never holds `consecutive` evaluations in a row."""
    compute = samples(200, noise=0.0)
    compute[6] = [0.40 * (1.7 if (s // 3) % 2 else 1.0) for s in range(200)]
    verdicts, _ = run(compute)
    assert verdicts == []


def test_flagged_rank_is_flagged_once_while_it_stays_slow() -> None:
    """Right at the ratio (1.5x, +-5 % noise) the score crosses it back and forth: one verdict."""
    verdicts, tracker = run(samples(300, noise=0.05, slow={1: (20, 1.5)}))
    assert [v.rank for v in verdicts] == [1]
    assert tracker.scores[1].straggler


def test_two_slow_ranks_in_one_stage_are_both_flagged() -> None:
    verdicts, _ = run(samples(60, slow={2: (20, 1.8), 7: (20, 1.8)}))
    assert sorted((v.rank, v.basis) for v in verdicts) == [(2, "relative"), (7, "relative")]


def test_slow_whole_stage_is_flagged_against_its_own_history_not_its_peers() -> None:
    verdicts, tracker = run(samples(60, slow={r: (25, 1.8) for r in (2, 3, 6, 7)}))
    assert sorted(v.rank for v in verdicts) == [2, 3, 6, 7]
    assert {v.basis for v in verdicts} == {"individual"}, "relative scores stay ~1 inside the stage"
    assert all(tracker.scores[r].relative == pytest.approx(1.0, abs=0.1) for r in (2, 3, 6, 7))
    assert not any(tracker.scores[r].straggler for r in (0, 1, 4, 5))


def test_peers_slowed_along_with_the_slow_rank_are_not_blamed() -> None:
    """Rank 6 computes 1.5x slower and, sharing CPU cores with it, its stage peers' compute grows
    1.35x (above the 1.3 ratio, against their own history): the stage is not slow as a whole, one rank
    in it is, and only that rank is flagged, on its relative score. (A CI run flagged 2, 3, 6, 7.)"""
    slow = {6: (60, 1.5 * 1.35), **{r: (60, 1.35) for r in (2, 3, 7)}}
    verdicts, tracker = run(samples(120, slow=slow), StragglerConfig(ratio=1.3))
    assert [(v.rank, v.basis) for v in verdicts] == [(6, "relative")]
    assert not any(tracker.scores[r].straggler for r in (2, 3, 7))


def test_the_host_slowing_down_while_one_rank_straggles_blames_that_rank_alone() -> None:
    """Rank 6 computes 2x from step 40; from step 60 every rank computes 1.8x (the host: on a
    2-core machine running 8 ranks the whole job's compute doubled within 20 steps). Stage 0 is then
    slower than its own history, but so is stage 1 apart from its straggler: the host, not stage 0.
    (Replayed over recorded cluster runs, the old rule blamed stage 0 in 163 of 1,408 injections.)"""
    compute = samples(120, slow={6: (40, 2.0)})
    for rank in compute:
        compute[rank] = [v * (1.8 if i >= 60 else 1.0) for i, v in enumerate(compute[rank])]
    verdicts, tracker = run(compute, StragglerConfig(ratio=1.3))
    assert [(v.rank, v.basis) for v in verdicts] == [(6, "relative")]
    assert not any(s.straggler for r, s in tracker.scores.items() if r != 6)


def test_slow_drift_of_the_whole_job_is_not_a_straggler() -> None:
    """Every rank's compute creeps up 40 % over 150 steps (numerics, a busier host): the trailing
    baseline absorbs it, and relative scores stay ~1."""
    compute = samples(150)
    for rank in compute:
        compute[rank] = [v * (1 + 0.4 * i / 150) for i, v in enumerate(compute[rank])]
    verdicts, _ = run(compute, StragglerConfig(ratio=1.3))
    assert verdicts == []


def test_the_whole_host_slowing_for_a_while_is_not_a_straggler() -> None:
    """Every rank 1.6x slower for 15 steps (another job on the host), one of them a bit more."""
    compute = samples(120)
    for rank in compute:
        extra = 1.75 if rank == 3 else 1.6
        compute[rank] = [v * (extra if 60 <= i < 75 else 1.0) for i, v in enumerate(compute[rank])]
    verdicts, _ = run(compute, StragglerConfig(ratio=1.3))
    assert verdicts == []


def test_slow_from_the_first_step_is_caught_by_its_peers() -> None:
    verdicts, _ = run(samples(40, slow={0: (1, 1.6)}))
    assert [(v.rank, v.basis) for v in verdicts] == [(0, "relative")]


def test_ratio_bounds_detection() -> None:
    """1.2x slowness is below the default 1.5 ratio, above a 1.1 one."""
    slow = samples(80, slow={4: (20, 1.2)})
    assert run(slow)[0] == []
    assert [v.rank for v in run(slow, StragglerConfig(ratio=1.1))[0]] == [4]


def test_a_step_is_scored_only_when_every_rank_reported_it() -> None:
    tracker = StragglerTracker({0: 0, 1: 0, 2: 0}, StragglerConfig(window=2, consecutive=1, warmup_steps=0))
    for step in range(1, 4):
        tracker.add(0, step, 1.0)
        tracker.add(1, step, 1.0)
    tracker.add(2, 1, 5.0)
    assert tracker.evaluate() == [] and 2 not in tracker.scores, "window not full yet"
    tracker.add(2, 2, 5.0)
    assert [v.rank for v in tracker.evaluate()] == [2]


# -- silent data corruption ---------------------------------------------------------------------

@pytest.mark.parametrize("values, odd, tie", [
    ({0: 7, 1: 7, 2: 7}, set(), False),
    ({0: 7, 1: 7, 2: 9}, {2}, False),
    ({0: 7, 1: 9}, {0, 1}, True),
    ({0: 7, 1: 7, 2: 9, 3: 9}, {0, 1, 2, 3}, True),
    ({0: 1, 1: 2, 2: 3}, {0, 1, 2}, True),
])
def test_minority(values: dict[int, int], odd: set[int], tie: bool) -> None:
    assert minority(values) == (odd, tie)


def ev(rank: int, **kw: object) -> RankEvidence:
    base = {"selftest": 11, "selftest_repeat": 11, "hardware": "cpu", "replicas": {f"tp-{rank // 2}": 5}}
    return RankEvidence(rank=rank, **{**base, **kw})  # type: ignore[arg-type]


def test_clean_evidence_has_no_suspect() -> None:
    assert sdc_verdict([ev(r) for r in range(8)]).clean


def test_params_changed_at_rest_names_the_rank() -> None:
    verdict = sdc_verdict([ev(r, params_intact=r != 5) for r in range(8)])
    assert verdict.suspects == (5,) and "at rest" in verdict.reasons[5][0]


def test_self_test_minority_and_non_repeatable() -> None:
    evidence = [ev(r) for r in range(8)]
    evidence[3] = ev(3, selftest=12, selftest_repeat=12)  # wrong but repeatable: majority says so
    evidence[6] = ev(6, selftest_repeat=13)  # not repeatable on itself
    assert sdc_verdict(evidence).suspects == (3, 6)


def test_self_tests_compare_only_within_the_same_hardware() -> None:
    evidence = [ev(r, hardware="H100") for r in range(4)] + [ev(r, hardware="A100", selftest=99, selftest_repeat=99)
                                                         for r in range(4, 8)]
    assert sdc_verdict(evidence).clean


def test_two_replicas_disagreeing_name_both_unless_evidence_picks_one() -> None:
    evidence = [ev(r) for r in range(8)]
    evidence[5] = ev(5, replicas={"tp-2": 6})
    assert sdc_verdict(evidence).suspects == (4, 5)
    evidence[5] = ev(5, replicas={"tp-2": 6}, selftest_repeat=0)
    assert sdc_verdict(evidence).suspects == (5,)


def test_hsdp_replica_minority() -> None:
    evidence = [RankEvidence(rank=r, replicas={"hsdp-0": 42 if r != 2 else 41}) for r in range(3)]
    assert sdc_verdict(evidence).suspects == (2,)


@pytest.mark.parametrize("loss, norm, recent, anomalous", [
    (2.0, 1.0, [1.0] * 10, False),
    (float("nan"), 1.0, [1.0] * 10, True),
    (2.0, float("inf"), [1.0] * 10, True),
    (2.0, 50.0, [1.0] * 10, True),
    (2.0, 50.0, [1.0] * 3, False),  # too little history to call a spike
    (None, 9.0, [1.0] * 10, False),  # not last stage: no loss; 9x is under the bound
])
def test_step_anomaly(loss: float | None, norm: float, recent: list[float], anomalous: bool) -> None:
    assert (step_anomaly(loss, norm, recent, spike_factor=10.0) is not None) is anomalous


def test_triage() -> None:
    clean = [ev(r) for r in range(4)]
    assert triage("loss is nan", None, clean).kind is Triage.TRANSIENT
    assert triage("loss is nan", "loss is nan", clean).kind is Triage.NOT_HARDWARE
    one = [ev(r, local_anomaly=r == 2) for r in range(4)]
    result = triage("loss is nan", "loss is nan", one)
    assert result.kind is Triage.PERSISTENT and result.suspects == (2,)
    flipped = [ev(r, params_intact=r != 1) for r in range(4)]
    result = triage("loss is nan", "loss is nan", flipped)
    assert result.kind is Triage.PERSISTENT and result.suspects == (1,)


# -- the vectorised tracker against a plain reference ---------------------------------------------

def reference(stage: dict[int, int], compute: dict[int, list[float]], c: StragglerConfig) -> list[tuple]:
    """The rules of health.straggler's docstring, one rank and one step at a time (independent of the
    tracker's arrays): (step, rank, basis, score) of each verdict."""
    import statistics

    seen: dict[int, list[float]] = {r: [] for r in stage}
    above = dict.fromkeys(stage, 0)
    below = dict.fromkeys(stage, 0)
    flagged = dict.fromkeys(stage, False)
    out = []
    for step in range(1, len(compute[0]) + 1):
        if step - 1 < c.warmup_steps:
            continue
        for r in stage:
            seen[r].append(compute[r][step - 1])
        if len(seen[0]) < c.window:
            continue
        recent = {r: statistics.median(seen[r][-c.window:]) for r in stage}
        individual: dict[int, float | None] = {}
        for r in stage:
            base = seen[r][:-c.window][-c.baseline_steps:] if c.baseline_steps else []
            usual = statistics.median(base) if len(base) >= max(c.min_baseline_steps, 1) else 0.0
            individual[r] = recent[r] / usual if usual > 0 else None
        relative = {}
        for r in stage:
            peers = [recent[q] for q in stage if stage[q] == stage[r] and q != r]
            typical = statistics.median(peers) if peers else 0.0
            relative[r] = recent[r] / typical if typical > 0 else 1.0
        stages = set(stage.values())
        slow = {s for s in stages
                if all((individual[r] or 0) > c.ratio and relative[r] <= c.ratio for r in stage if stage[r] == s)}
        slow = slow if len(slow) < len(stages) else set()
        for r in stage:
            worst, basis = relative[r], "relative"
            if worst <= c.ratio and stage[r] in slow:
                worst, basis = individual[r] or 1.0, "individual"
            above[r] = above[r] + 1 if worst > c.ratio else 0
            below[r] = below[r] + 1 if worst < 1 + (c.ratio - 1) / 2 else 0
            if not flagged[r] and above[r] >= c.consecutive:
                flagged[r] = True
                out.append((step, r, basis, round(worst, 9)))
            elif flagged[r] and below[r] >= c.consecutive:
                flagged[r] = False
    return sorted(out)


@pytest.mark.parametrize("seed", range(12))
def test_the_tracker_agrees_with_the_plain_reference(seed: int) -> None:
    """Random meshes, noise, single slow ranks, whole slow stages, slowdowns that come and go (so
    flags clear), a short baseline: the same verdicts at the same steps, on the same basis and score."""
    rng = random.Random(seed)
    stages = rng.choice([1, 2, 4])
    per_stage = rng.choice([1, 2, 3, 5, 8])
    stage = {r: r % stages for r in range(stages * per_stage)}
    steps = 120
    compute = {r: [0.3 * (1 + stage[r]) * (1 + rng.uniform(-0.1, 0.1)) for _ in range(steps)] for r in stage}
    for _ in range(rng.randint(1, 4)):
        start, length, factor = rng.randint(1, 100), rng.randint(3, 60), rng.choice([1.3, 1.6, 2.5])
        who = [rng.choice(list(stage))] if rng.random() < 0.6 else [r for r in stage if stage[r] == rng.randrange(stages)]
        for r in who:
            for i in range(start - 1, min(start - 1 + length, steps)):
                compute[r][i] *= factor
    config = StragglerConfig(ratio=rng.choice([1.2, 1.5]), window=rng.choice([3, 5]), consecutive=rng.choice([1, 4]),
                             warmup_steps=rng.choice([0, 2]), baseline_steps=rng.choice([6, 30]),
                             min_baseline_steps=rng.choice([3, 10]))
    tracker = StragglerTracker(stage, config)
    got = []
    for step in range(1, steps + 1):
        for rank in rng.sample(list(stage), len(stage)):  # reports come in any order
            tracker.add(rank, step, compute[rank][step - 1])
        got += [(v.step, v.rank, v.basis, round(v.score, 9)) for v in tracker.evaluate()]
    assert sorted(got) == reference(stage, compute, config)


def test_a_whole_step_at_once_scores_as_its_samples_do_and_gaps_are_skipped() -> None:
    """`add_step` (a simulation's samples of every rank) judges as `add` per rank does; a step some
    rank never reported does not hold back the whole steps after it."""
    compute = samples(60, slow={5: (30, 1.7)})
    ranks = list(STAGE)
    one, whole = StragglerTracker(STAGE, StragglerConfig()), StragglerTracker(STAGE, StragglerConfig())
    got_one, got_whole = [], []
    for step in range(1, 61):
        for r in ranks:
            one.add(r, step, compute[r][step - 1])
        got_one += one.evaluate()
        whole.add_step(step, [compute[r][step - 1] for r in ranks])
        if step % 7 == 0:
            whole.add(3, step + 100, 9.9)  # a lone sample of a later step: never whole, never in the way
        got_whole += whole.evaluate()
    assert got_one == got_whole and [v.rank for v in got_one] == [5]
    assert one.scores[5] == whole.scores[5] and whole.scores[5].straggler
    gappy = StragglerTracker(STAGE, StragglerConfig())
    verdicts = []
    for step in range(1, 61):
        for r in ranks:
            if not (r == 2 and step % 3 == 0):  # rank 2's report of every third step is lost
                gappy.add(r, step, compute[r][step - 1])
        verdicts += gappy.evaluate()
    assert [v.rank for v in verdicts] == [5] and len(gappy._by_step) <= 1  # noqa: SLF001
    with pytest.raises(ValueError, match="3 samples for 8 ranks"):
        whole.add_step(99, [1.0, 1.0, 1.0])
