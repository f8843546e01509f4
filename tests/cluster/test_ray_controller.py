"""The controller on a real local Ray cluster (4 raylets): a dp2 x pp2 x tp2 tiny GPT runs to the end
with every actor on the node its placement names, the loss falls, and a second run of the same
spec after an interrupted first one resumes from the last checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.ray.cluster import LocalRayCluster
from controller.ray.runner import drive
from controller.run_state import RunState
from controller.spec import RunSpec, parse_spec
from controller.state import RunController

pytestmark = pytest.mark.cluster


def tiny_spec(name: str, root: Path, steps: int, every: int) -> RunSpec:
    return parse_spec({
        "name": name,
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 64, "seq_len": 32},  # a block per stage
        "data": {"kind": "synthetic", "seed": 0},
        "train": {"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 1e-2},
        "parallelism": {"dp": 2, "pp": 2, "tp": 2},
        "cluster": {"local": {"nodes": 4, "gpus_per_node": 2, "racks": 2}},
        "checkpoint": {"uri": f"file://{root}", "every_steps": every, "keep": 2},
    })


def test_runs_to_completion_where_placed(ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    spec = tiny_spec("placed", tmp_path, steps=25, every=100)
    seen: dict[str, list] = {}

    def on_tick(c: RunController) -> None:
        if c.state is RunState.RUNNING and "where" not in seen:
            seen["where"] = c.worker_group.where()  # type: ignore[attr-defined]

    c = drive(spec, ray_cluster, on_tick=on_tick)
    assert c.state is RunState.SUCCEEDED, c.error
    assert c.progress.step == 25
    name_of = {n.ray_node_id: n.name for n in ray_cluster.topology().nodes}
    assert c.placement is not None
    actual = [name_of[w["node_id"]] for w in seen["where"]]
    assert actual == list(c.placement.node_of_rank)
    assert len(set(actual)) == 4
    losses = [h["loss"] for h in c.progress.history]
    assert losses[-1] < losses[0] - 1.0, f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    kinds = c.events.kinds()
    assert kinds[:3] == ["submitted", "planned", "attempt_started"] and kinds[-1] == "succeeded"


def test_second_run_resumes_interrupted_first(ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    spec = tiny_spec("resumable", tmp_path, steps=12, every=4)

    def cancel_after_step_8_commit(c: RunController) -> None:
        # once step 8 is committed and step 9 is done: the resumed run redoes step 9, and must match it
        if c.progress.step >= 9 and any(e.detail.get("step") == 8 for e in c.events.of_kind("checkpoint_committed")):
            c.cancel()

    def timeline(c: RunController) -> str:  # (a string: pytest prints it whole)
        return "\n".join(f"{e.time:.2f} {e.kind} {e.detail}" for e in c.events.view())

    first = drive(spec, ray_cluster, on_tick=cancel_after_step_8_commit)
    assert first.state is RunState.CANCELLED, timeline(first)
    stopped_at = first.progress.step
    assert 9 <= stopped_at < 12, timeline(first)
    first_losses = {h["step"]: h["loss"] for h in first.progress.history}

    second = drive(spec, ray_cluster)
    assert second.state is RunState.SUCCEEDED, f"{second.error}\n{timeline(second)}"
    started = second.events.of_kind("attempt_started")[0].detail
    assert started["start_step"] == 8 and started["resume_step"] == 8, timeline(first) + "\n" + timeline(second)
    assert len(second.events.of_kind("restored")) == 8, "every rank restores\n" + timeline(second)
    steps = [h["step"] for h in second.progress.history]
    assert steps == list(range(9, 13)), "the step count continues after the checkpoint\n" + timeline(second)
    # Same mesh, same data cursor: step 9 redone after the resume equals step 9 of the first run
    # (CPU fp32 is deterministic here).
    assert second.progress.history[0]["step"] == 9
    assert second.progress.history[0]["loss"] == pytest.approx(first_losses[9], rel=1e-6), \
        f"{first.progress.history}\n{second.progress.history}"


def test_a_launch_asks_again_for_a_reservation_ray_has_not_granted_and_starts_when_it_is(
        ray_cluster: LocalRayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node-1's two GPU slots are held by someone else's placement group when the run launches, and
    given back 6 s later. The launch asks Ray again for its reservation there every second meanwhile
    (each time dropping the ungranted one: a pending group can stay unscheduled until a node joins,
    ray#62483), then starts and trains; none of the groups it dropped is left behind."""
    import contextlib
    import threading

    import ray
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import placement_group

    from controller.ray import pool

    monkeypatch.setattr(pool, "RESERVATION_RETRY_S", 1.0)
    before = set(placement_group_table())
    blocker = placement_group([{"GPU": 1.0}, {"GPU": 1.0}], strategy="PACK",
                              bundle_label_selector=[{"node": "node-1"}, {"node": "node-1"}])
    assert blocker.wait(30), "the test's own reservation of node-1 was not granted"
    timer = threading.Timer(6.0, remove_placement_group, args=(blocker,))
    timer.start()
    try:
        c = drive(tiny_spec("asked-again", tmp_path, steps=3, every=100), ray_cluster)
    finally:
        timer.cancel()
        with contextlib.suppress(Exception):  # (the timer may have removed it already)
            remove_placement_group(blocker)
    assert c.state is RunState.SUCCEEDED, c.error
    asked = c.worker_group.pool.reservations_asked_again  # type: ignore[attr-defined]
    assert asked >= 3, f"the launch asked again {asked} time(s) in 6 s"
    ours = {pg: info for pg, info in placement_group_table().items() if pg not in before and pg != blocker.id.hex()}
    assert ours and all(info["state"] == "REMOVED" for info in ours.values()), \
        {pg: info["state"] for pg, info in ours.items()}
    assert ray.is_initialized()
