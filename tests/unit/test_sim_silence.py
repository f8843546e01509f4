"""Silent failures in the simulator (controller/sim/model.py): which of the Llama 3 report's rows close
nothing, the share of a long incident stream that comes out silent, and what each one costs: a silent
node loss is found by the heartbeat (its timeout, the next poll and the raylet probe) on both paths,
a loud one by the data plane, a hung rank when the survivors' collectives time out."""

from __future__ import annotations

import math
from typing import Any

import pytest

from controller.sim.model import LLAMA3_COUNTS, SILENT_SHARE, Incident, comm_init_s, incidents
from controller.sim.run import simulate
from controller.spec import FailureModelSpec
from tests.unit.test_sim_replica import REPLICAS, replica_spec
from tests.unit.test_simulate import LLAMA3_TABLE_5, spec

SILENT_ROWS = {"Network Switch/Cable", "NIC", "Power Supply", "Server Chassis", "CPU", "System Memory",
               "NCCL Watchdog Timeouts"}
"""Table 5's rows in which nothing closes: a dead link, a host without power or whose kernel stopped,
a hang by name. The rest end a process on a live kernel."""
HEARTBEAT_DETECTION_S = 1.0 + 0.2 + 0.3
"""By hand: a node's beats unmoved for 1 s (health/heartbeat.py), the controller's next poll (0.2 s),
the raylet probe's unanswered wait (0.3 s, controller/ray/liveness.py)."""
STRUCK_AT = 26.0
"""Step 25's end in the tiny spec: 25 steps of 1 s and the saves after 10 and 20 (0.5 s each)."""


def test_the_detection_takes_the_edges_own_constants() -> None:
    from controller.ray.liveness import RAYLET_PROBE_S
    from controller.sim import model
    from health.heartbeat import HEARTBEAT_TIMEOUT_S

    assert model.RAYLET_PROBE_S == RAYLET_PROBE_S and model.SILENT_DETECTION_S == HEARTBEAT_TIMEOUT_S + 0.2 + 0.3


def test_the_silent_share_is_the_report_row_by_row() -> None:
    silent: dict[str, int] = {}
    for row, (component, count) in LLAMA3_TABLE_5.items():
        silent[component] = silent.get(component, 0) + (count if row in SILENT_ROWS else 0)
    assert SILENT_SHARE == pytest.approx({c: silent.get(c, 0) / n for c, n in LLAMA3_COUNTS.items()})
    assert sum(silent.values()) == 35 + 7 + 3 + 2 + 2 + 2 + 7 == 58  # of 419


@pytest.mark.parametrize("share", [None, {"gpu": 0.3, "host": 0.5, "network": 1.0, "storage": 0.05, "software": 0.0}])
def test_a_long_stream_is_silent_in_its_configured_share(share: dict[str, float] | None) -> None:
    """Each component's silent count is binomial(n, p): it stays within 4.5 standard deviations of
    n x p (a chance of ~7e-6 per component of failing a correct model), a bound set by n alone."""
    nodes = [f"node-{i}" for i in range(2048)]
    failures = FailureModelSpec(sdc_share=0.0)
    stream = incidents(failures, nodes, horizon_s=20 * 365 * 86400.0, seed=3, silent_share=share)
    expected = SILENT_SHARE if share is None else share
    for component, p in expected.items():
        these = [i for i in stream if i.component == component]
        n, k = len(these), sum(i.silent for i in these)
        assert n > 1000, (component, n)  # enough for the bound to say something
        assert abs(k - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)), (component, n, k, p)


def test_silence_leaves_a_seeds_times_components_and_nodes_as_they_were() -> None:
    nodes = [f"node-{i}" for i in range(64)]
    none = {c: 0.0 for c in LLAMA3_COUNTS}
    before = incidents(FailureModelSpec(), nodes, horizon_s=200 * 86400.0, seed=11, silent_share=none)
    after = incidents(FailureModelSpec(), nodes, horizon_s=200 * 86400.0, seed=11)
    assert [(i.time, i.component, i.node) for i in before] == [(i.time, i.component, i.node) for i in after]
    assert not any(i.silent for i in before) and any(i.silent for i in after)
    # A silent storage incident is a host gone dark: repaired in the host's hours; the others keep theirs
    repair = FailureModelSpec().repair_hours
    for i in after:
        component = "gpu" if i.component in ("sdc", "straggler") else i.component  # (kinds of GPU incident)
        hours = repair.host if component == "storage" and i.silent else getattr(repair, component)
        assert i.repair_s == pytest.approx(hours * 3600.0), i


def struck(monkeypatch: pytest.MonkeyPatch, *planned: Incident) -> None:
    """The failure model's incidents, replaced by `planned`."""
    monkeypatch.setattr("controller.sim.run.incidents", lambda *args, **kwargs: list(planned))


# (path, component, silent) -> (cause, detection by hand). The tiny spec's world path charges its
# own node_loss_detection_s (0.9 s) for a loud node loss; the replica path the data plane's 1 s.
CASES = [
    ("world", "host", False, "node_lost", 0.9),
    ("world", "host", True, "node_lost", HEARTBEAT_DETECTION_S),
    ("world", "storage", True, "node_lost", HEARTBEAT_DETECTION_S),  # the host went dark
    ("replica", "host", False, "node_lost", 1.0),
    ("replica", "host", True, "node_lost", HEARTBEAT_DETECTION_S),
    ("replica", "gpu", True, "node_lost", HEARTBEAT_DETECTION_S),
    ("replica", "storage", True, "node_lost", HEARTBEAT_DETECTION_S),
]


@pytest.mark.parametrize("path,component,silent,cause,detection", CASES)
def test_a_silent_node_loss_waits_for_the_heartbeat_and_a_loud_one_for_the_data_plane(
        monkeypatch: pytest.MonkeyPatch, path: str, component: str, silent: bool, cause: str, detection: float) -> None:
    struck(monkeypatch, Incident(time=STRUCK_AT, component=component, node="node-1", repair_s=3600.0, silent=silent))
    run = replica_spec(drills=[]) if path == "replica" else spec(parallelism=REPLICAS)
    result = simulate(run, days=1)
    assert result["state"] == "succeeded" and result["steps"] == 100
    (failure,) = result["goodput"]["failures"]
    assert failure["cause"] == cause
    assert failure["onset"] == pytest.approx(STRUCK_AT)
    assert failure["detection_seconds"] == pytest.approx(detection)
    # The survivors stalled through the detection: they go on only after it and their recovery
    # (replica: one cross-replica init of 1; world: the tiny spec's restart 0 s + restore 2 s).
    assert failure["recovery_seconds"] == pytest.approx(comm_init_s(1) if path == "replica" else 2.0)
    # The step in flight had just begun; the world path also redoes steps 21-25 from the store's step 20
    assert failure["recomputation_seconds"] == pytest.approx(0.0 if path == "replica" else 5.0)


@pytest.mark.parametrize("path", ["world", "replica"])
def test_a_hung_rank_is_found_when_the_collectives_time_out_and_a_bug_at_once(
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """NCCL watchdog timeouts (software's silent share) leave the host beating: the heartbeat cannot
    see them, the survivors' collectives time out (the spec's 30 s). A bug's error comes at once.
    Both then wait the controller's attribution grace alike."""
    detected = {}
    for silent in (False, True):
        struck(monkeypatch, Incident(time=STRUCK_AT, component="software", node="node-1", repair_s=0.0, silent=silent))
        run = replica_spec(drills=[]) if path == "replica" else spec(parallelism=REPLICAS)
        result: dict[str, Any] = simulate(run, days=1)
        (failure,) = result["goodput"]["failures"]
        detected[silent] = failure["detection_seconds"]
    assert detected[True] - detected[False] == pytest.approx(30.0)  # health.collective_timeout_s
