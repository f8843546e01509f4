"""/metrics over a service whose run is driven by a fake worker group: every exported family is one
`controller/service/metrics.py` defines (and every defined one is there), labels stay low-cardinality,
and the numbers agree with an independent reference — the Run object the API shows, the step times
the fake workers reported, and the failure the test made."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from controller.service.app import create_app
from controller.service.metrics import CATEGORIES, METRICS, exported_series
from tests.unit.test_api import live_run

ALLOWED_LABELS = {"run", "rank", "node", "cause", "kind", "state", "category", "outcome", "source", "team", "priority"}  # source: peer, store, scratch


def scrape(api: TestClient, **headers: str) -> dict[str, Any]:
    response = api.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    base = name
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        base = base.removesuffix(suffix)
    family = families[base]
    hits = [s.value for s in family.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return float(hits[0])


def test_definitions_are_unique_and_documented() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert m.name.startswith("goodput_") and m.help and m.type in ("gauge", "counter", "histogram"), m
        assert set(m.labels) <= ALLOWED_LABELS, m
        assert not m.name.endswith("_total"), "a counter's name is given without _total"
        assert (m.type == "histogram") == bool(m.buckets), m
    assert "goodput_failures_total" in exported_series() and "goodput_step_seconds_bucket" in exported_series()


def test_a_run_with_a_failure_is_exported_as_its_run_object_says() -> None:
    c, g, _, service, live = live_run()
    api = TestClient(create_app(service))
    g.finish_steps(1, 4, end=110.0)  # 2 s of steps, later redone
    live.step(110.0)
    g.lose_node(c.placement.node_of_rank[7])  # type: ignore[union-attr]
    live.step(111.0)
    t = 112.0
    while c.attempt == 0:
        live.step(t)
        t += 1
    while c.state.value != "running":
        live.step(t)
        t += 1
    g.finish_steps(1, 3, end=t + 5)  # back to back: 1.5 s of steps ending at t + 5
    live.step(t + 5)
    families = scrape(api)

    # Every family defined is exported, with its type and help; nothing undefined is.
    defined = {m.name: m for m in METRICS}
    ours = {n: f for n, f in families.items() if n.startswith("goodput_")}
    assert set(ours) == set(defined)
    for name, family in ours.items():
        assert family.type == defined[name].type and family.documentation == defined[name].help
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= set(defined[name].labels), sample
            assert not any(v.isdigit() and int(v) > 1000 for v in sample.labels.values()), "no step numbers"

    run = service.run("tiny-gpt")
    assert value(families, "goodput_run_state", run="tiny-gpt", state="running") == 1
    assert value(families, "goodput_run_state", run="tiny-gpt", state="pending") == 0
    assert value(families, "goodput_run_attempt", run="tiny-gpt") == run["attempt"] == 1
    assert value(families, "goodput_run_step", run="tiny-gpt") == run["step"]
    assert value(families, "goodput_run_loss", run="tiny-gpt") == pytest.approx(run["loss"])
    # ETTR by hand: the run was submitted at t=100 and is scraped at the clock's time; of its steps only
    # attempt 1's three (0.5 s each, the fake's step time) were kept: attempt 0's four were redone.
    wall = live.clock() - 100.0
    assert value(families, "goodput_run_wall_seconds", run="tiny-gpt") == pytest.approx(wall)
    assert value(families, "goodput_run_productive_seconds", run="tiny-gpt") == pytest.approx(3 * 0.5)
    assert value(families, "goodput_run_ettr", run="tiny-gpt") == pytest.approx(3 * 0.5 / wall)
    assert value(families, "goodput_run_badput_seconds", run="tiny-gpt", category="recomputation") >= 4 * 0.5
    goodput = c.goodput(live.clock())
    assert value(families, "goodput_run_ettr", run="tiny-gpt") == pytest.approx(goodput["ettr"])
    badput = {k: value(families, "goodput_run_badput_seconds", run="tiny-gpt", category=k) for k in CATEGORIES}
    assert badput == pytest.approx(goodput["badput_seconds"])
    assert (value(families, "goodput_run_productive_seconds", run="tiny-gpt") + sum(badput.values())
            == pytest.approx(value(families, "goodput_run_wall_seconds", run="tiny-gpt"), abs=1e-3))
    assert value(families, "goodput_attempt_ettr", run="tiny-gpt") == pytest.approx(goodput["attempts"][-1]["ettr"])

    # Step times: 7 executions of 0.5 s each (the fake workers' report), all in the 0.5 bucket.
    assert value(families, "goodput_step_seconds_count", run="tiny-gpt") == 7
    assert value(families, "goodput_step_seconds_sum", run="tiny-gpt") == pytest.approx(3.5)
    assert value(families, "goodput_step_seconds_bucket", run="tiny-gpt", le="0.25") == 0
    assert value(families, "goodput_step_seconds_bucket", run="tiny-gpt", le="0.5") == 7

    # The failure: counted once by cause, every other cause present at 0; one detection, one recovery.
    assert value(families, "goodput_failures_total", run="tiny-gpt", cause="node_lost") == 1
    assert value(families, "goodput_failures_total", run="tiny-gpt", cause="sdc") == 0
    (failure,) = goodput["failures"]
    assert value(families, "goodput_failure_detection_seconds_count", run="tiny-gpt") == 1
    assert value(families, "goodput_failure_detection_seconds_sum", run="tiny-gpt") == pytest.approx(
        failure["detection_seconds"])
    assert value(families, "goodput_recovery_seconds_sum", run="tiny-gpt") == pytest.approx(failure["recovery_seconds"])
    assert value(families, "goodput_sdc_events_total", run="tiny-gpt", kind="sdc_suspect") == 0

    # Nodes: the cluster's five, one a spare.
    nodes = {s.labels["state"]: s.value for s in families["goodput_nodes"].samples}
    assert sum(nodes.values()) == 5 and nodes["spare"] + nodes["healthy"] + nodes["lost"] == 5


def test_checkpoints_sdc_and_drills_are_counted_from_the_timeline() -> None:
    c, g, injector, service, live = live_run()
    api = TestClient(create_app(service))
    g.finish_steps(1, 10)
    g.emit(0, "checkpoint_staged", step=10, blocked_s=0.2)
    g.emit(0, "checkpoint_committed", step=10, uri="file://x", bytes=12345, seconds=1.5, removed=[])
    g.emit(3, "sdc_transient", step=10, ranks=[3])
    live.step(110.0)
    live.clock.t = 117.0
    families = scrape(api)
    assert value(families, "goodput_checkpoint_last_bytes", run="tiny-gpt") == 12345
    assert value(families, "goodput_checkpoint_last_step", run="tiny-gpt") == 10
    assert value(families, "goodput_checkpoint_age_seconds", run="tiny-gpt") == pytest.approx(7.0)
    # every_steps 10 x the 0.5 s median step
    assert value(families, "goodput_checkpoint_interval_seconds", run="tiny-gpt") == pytest.approx(5.0)
    assert value(families, "goodput_checkpoint_save_seconds_sum", run="tiny-gpt") == pytest.approx(1.5)
    assert value(families, "goodput_checkpoint_stall_seconds_sum", run="tiny-gpt") == pytest.approx(0.2)
    assert value(families, "goodput_sdc_events_total", run="tiny-gpt", kind="sdc_transient") == 1
    # A second scrape folds in only what is new: nothing counted twice.
    api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-rank", "target": 5})
    live.step(111.0)
    again = scrape(api)
    assert value(again, "goodput_sdc_events_total", run="tiny-gpt", kind="sdc_transient") == 1
    assert value(again, "goodput_checkpoint_save_seconds_count", run="tiny-gpt") == 1
    assert value(again, "goodput_drills_total", run="tiny-gpt", kind="kill-rank", outcome="pending") == 1


def test_metrics_need_the_token() -> None:
    *_, service, _ = live_run()
    api = TestClient(create_app(service, token="s3cret"))
    assert api.get("/metrics").status_code == 401
    assert "goodput_run_state" in scrape(api, authorization="Bearer s3cret")


def test_the_replica_protocol_is_counted_and_a_heal_is_timed() -> None:
    """Issue 44: discarded steps (once per step, however many replicas say so), the epochs that
    resolved one, and each lost replica's heal (its loss to its rejoin) are exported for the run."""
    c, g, _, service, live = live_run()
    api = TestClient(create_app(service))
    g.emit(0, "replica_step_discarded", step=5, epoch=0, error="injected")
    g.emit(4, "replica_step_discarded", step=5, epoch=0, error="injected")  # (the other replica's rank 0)
    g.emit(-1, "replica_resync", epoch=1, discarded_at=0, step=5)
    live.step(110.0)
    c.events.add(111.0, c.attempt, "replica_lost", replicas=[1], nodes=["n"], live=1, of=2, batch="keep")
    g.emit(4, "replica_rejoined", replicas=[1], epoch=2, step=9, source=0, at=118.5, seconds=0.4)
    live.step(119.0)
    families = scrape(api)
    assert value(families, "goodput_replica_steps_discarded_total", run="tiny-gpt") == 1
    assert value(families, "goodput_replica_resyncs_total", run="tiny-gpt") == 1
    assert value(families, "goodput_replica_heal_seconds_count", run="tiny-gpt") == 1
    assert value(families, "goodput_replica_heal_seconds_sum", run="tiny-gpt") == pytest.approx(7.5)
