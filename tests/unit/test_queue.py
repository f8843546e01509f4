"""Whose turn it is on a shared service (issue 45): the queue orders runs by priority class, then by
their team's fair share (the part of its GPU quota in use), then by submission; a run waiting for
capacity holds back every run after it (a big run is never starved by small ones arriving later), a
run waiting for its own team's quota holds back no other team; a run its team's quota could never
hold, or a priority class that does not exist, is refused at submission with what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.errors import ServiceError
from controller.service.accounts import Accounts
from controller.service.registry import sqlite_url
from controller.service.scheduler import Queued, queue_order, quota_problem
from controller.spec import SpecError, parse_spec
from tests.unit.test_service import Harness, raw_spec


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from([0, 100, 200]), st.integers(1, 8)),
                max_size=12),
       st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 16)),
       st.dictionaries(st.sampled_from(["a", "b", "c"]), st.one_of(st.none(), st.integers(1, 16))))
def test_the_queue_orders_by_priority_then_fair_share_then_submission(
        runs: list[tuple[str, int, int]], usage: dict[str, int], quotas: dict[str, int | None]) -> None:
    queued = [Queued(seq=i, team=team, priority=p, gpus=g) for i, (team, p, g) in enumerate(runs)]
    order = queue_order(queued, usage, quotas, total_gpus=16)
    assert sorted(order, key=lambda q: q.seq) == queued, "a permutation"

    def share(team: str) -> float:
        return usage.get(team, 0) / (quotas.get(team) or 16)

    for first, then in zip(order, order[1:]):  # every neighbour pair in order, by the rule read plainly
        assert first.priority >= then.priority
        if first.priority == then.priority:
            assert share(first.team) <= share(then.team)
            if share(first.team) == share(then.team):
                assert first.seq < then.seq


def test_a_quota_counts_what_the_team_holds_and_what_the_run_asks() -> None:
    run = Queued(seq=0, team="a", priority=100, gpus=4)
    assert quota_problem(run, {"a": 4}, {"a": 8}) is None
    assert quota_problem(run, {"a": 6}, {"a": None}) is None
    why = quota_problem(run, {"a": 6}, {"a": 8})
    assert why is not None and "its runs hold 6 of its 8 GPU(s) and this one needs 4" in why


def shared_harness(tmp_path: Path) -> tuple[Harness, Accounts]:
    h = Harness(sqlite_url(str(tmp_path)))
    accounts = Accounts(h.registry, service_token=None)
    accounts.add_team("vision", gpu_quota=4)
    accounts.add_team("nlp")
    return h, accounts


def test_a_run_waiting_for_its_teams_quota_holds_back_no_other_team(tmp_path: Path) -> None:
    h, _ = shared_harness(tmp_path)
    s = h.service
    s.add(parse_spec(raw_spec("v1", dp=2, tp=2)), team="vision")  # 4 GPUs: vision's whole quota
    s.add(parse_spec(raw_spec("v2", dp=1, tp=2)), team="vision")  # 2 more: over it
    s.add(parse_spec(raw_spec("n1", dp=1, tp=2)), team="nlp")  # submitted after v2, fits
    h.until("v1", "running", "n1")
    waiting = s.run("v2")
    assert waiting["state"] == "pending" and "team vision's quota" in waiting["waiting_for"], waiting
    assert "its runs hold 4 of its 4 GPU(s) and this one needs 2" in waiting["waiting_for"]
    assert s.run("n1")["state"] == "running" and s.usage() == {"vision": 4, "nlp": 2}
    h.group("v1").finish_steps(1, 40)
    h.group("v1").complete()
    h.until("v1", "succeeded")
    h.tick("v2")
    assert s.run("v2")["state"] in ("launching", "running")


def test_a_higher_priority_run_goes_first_and_the_team_using_less_of_its_quota_next(tmp_path: Path) -> None:
    h, accounts = shared_harness(tmp_path)
    accounts.add_team("speech", gpu_quota=8)
    accounts.add_team("batch")
    s = h.service
    fills = ["b1", "b2", "b3"]
    for name in fills:
        s.add(parse_spec(raw_spec(name, dp=1, tp=2, priority="low")), team="batch")
    s.add(parse_spec(raw_spec("n-held", dp=1, tp=2)), team="nlp")  # 8 GPUs taken; nlp holds 2 of them
    h.until("n-held", "running", *fills)
    s.add(parse_spec(raw_spec("n-normal", dp=1, tp=2)), team="nlp")
    s.add(parse_spec(raw_spec("s-normal", dp=1, tp=2)), team="speech")  # later, but speech holds nothing
    s.add(parse_spec(raw_spec("v-high", dp=1, tp=2, priority="high")), team="vision")  # last, but high
    h.tick()
    assert "waiting for capacity" in s.run("v-high")["waiting_for"]
    assert all("queued ahead of it" in s.run(r)["waiting_for"] for r in ("n-normal", "s-normal"))
    assert s.run("v-high")["priority"] == "high" and s.run("n-normal")["priority"] == "normal"
    admitted = []
    for done in ("b2", "b3", "n-held"):  # 2 GPUs free at a time: one run admitted each time
        h.group(done).finish_steps(1, 40)
        h.group(done).complete()
        h.until(done, "succeeded")
        h.tick()
        admitted += [r for r in ("v-high", "s-normal", "n-normal")
                     if r not in admitted and s.run(r)["state"] in ("launching", "running")]
    assert admitted == ["v-high", "s-normal", "n-normal"]


def test_the_fair_share_puts_the_team_using_less_first(tmp_path: Path) -> None:
    h, accounts = shared_harness(tmp_path)
    accounts.add_team("speech", gpu_quota=8)
    s = h.service
    s.add(parse_spec(raw_spec("n-run", dp=2, tp=2)), team="nlp")  # nlp: 4 GPUs, no quota: 4 of the cluster's 8
    s.add(parse_spec(raw_spec("s-run", dp=1, tp=2)), team="speech")  # speech: 2 of its 8
    h.until("n-run", "running", "s-run")
    s.add(parse_spec(raw_spec("n-next", dp=1, tp=2)), team="nlp")  # first in; nlp's share 0.5
    s.add(parse_spec(raw_spec("s-next", dp=1, tp=2)), team="speech")  # speech's 0.25: before nlp's
    s.add(parse_spec(raw_spec("v-next", dp=1, tp=2)), team="vision")  # vision holds nothing: first of all
    h.tick()  # 2 GPUs are free: vision's takes them, speech's waits for capacity, nlp's behind it
    assert s.run("v-next")["state"] in ("launching", "running")
    assert "waiting for capacity" in s.run("s-next")["waiting_for"]
    assert "queued ahead of it" in s.run("n-next")["waiting_for"]


def test_a_big_run_waiting_for_capacity_is_not_overtaken_by_small_ones(tmp_path: Path) -> None:
    h, _ = shared_harness(tmp_path)
    s = h.service
    s.add(parse_spec(raw_spec("half", dp=2, tp=2)), team="nlp")
    h.until("half", "running")
    s.add(parse_spec(raw_spec("big", dp=4, tp=2)), team="nlp")  # needs all 8: waits
    s.add(parse_spec(raw_spec("small", dp=1, tp=2)), team="nlp")  # would fit the 4 free: waits behind it
    h.tick()
    assert "waiting for capacity" in s.run("big")["waiting_for"]
    assert s.run("small")["state"] == "pending" and "queued ahead of it" in s.run("small")["waiting_for"]
    h.group("half").finish_steps(1, 40)
    h.group("half").complete()
    h.until("half", "succeeded")
    h.tick("big")
    assert s.run("big")["state"] in ("launching", "running") and s.run("small")["state"] == "pending"


def test_a_run_its_quota_could_never_hold_and_an_unknown_priority_are_refused_at_submission(tmp_path: Path) -> None:
    h, _ = shared_harness(tmp_path)
    with pytest.raises(ServiceError) as e:
        h.service.add(parse_spec(raw_spec("too-big", dp=4, tp=2)), team="vision")
    assert e.value.code == "over_quota" and "quota is 4 GPU(s) and this run needs 8" in e.value.message
    with pytest.raises(SpecError, match="priority class 'urgent' does not exist: one of low, normal, high, critical"):
        parse_spec(raw_spec("x", priority="urgent"))


def test_each_teams_usage_quota_and_queue_are_shown_and_exported(tmp_path: Path) -> None:
    from controller.service.metrics import ServiceCollector

    h, _ = shared_harness(tmp_path)
    s = h.service
    s.add(parse_spec(raw_spec("v1", dp=2, tp=2)), team="vision")
    h.until("v1", "running")
    s.add(parse_spec(raw_spec("v2", dp=1, tp=2, priority="high")), team="vision")  # over vision's quota: queued
    h.tick()
    h.clock.t += 30
    teams = {t["name"]: t for t in s.teams_view()}
    assert (teams["vision"]["gpu_quota"], teams["vision"]["gpus_held"], teams["vision"]["queued"]) == (4, 4, 1)
    assert teams["vision"]["longest_wait_s"] >= 30 and teams["nlp"]["gpus_held"] == 0 and teams["nlp"]["gpu_quota"] is None
    samples = {(m.name, tuple(sorted(x.labels.items()))): x.value
               for m in ServiceCollector(s).collect() for x in m.samples}
    assert samples[("goodput_team_gpus", (("team", "vision"),))] == 4
    assert samples[("goodput_team_gpu_quota", (("team", "vision"),))] == 4
    assert ("goodput_team_gpu_quota", (("team", "nlp"),)) not in samples
    assert samples[("goodput_team_queued_runs", (("team", "vision"),))] == 1
    assert samples[("goodput_team_queue_wait_seconds", (("team", "vision"),))] == teams["vision"]["longest_wait_s"]
    assert samples[("goodput_run_info", (("priority", "high"), ("run", "v2"), ("team", "vision")))] == 1
