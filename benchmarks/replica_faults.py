"""The survivors' stall under `failure_domain: replica` on the embedded Ray cluster, with the
controller's detection and its publish of the next membership epoch in the figure (issue 44). On
`make run`'s mesh as two replicas (dp2 x pp2 x tp2, dp_replicas 2, five nodes with one hot spare,
tuned failure detection, warm actors, a peer snapshot every step), one drill per run at step 5 on
replica 1, the two kinds interleaved (the order alternates by round):

- kill-node: replica 1's last node SIGKILLed (raylet and every process on it). Figure: SIGKILL ->
  the survivors' first committed step after it ends (`first_step_after_recovery`, survivors).
  Goal: <= detection (SIGKILL -> `failure_detected`) + one step + 0.5 s, the step being the
  survivors' own while replica 1 is out (they keep the global batch: twice the work of a step of
  two replicas); the goal against a step before the loss is printed beside it.
- collective-fault: replica 1's last rank fails its next gradient reduce across replicas (a
  transient collective error; nothing lost). Every replica discards the step; the controller
  publishes an epoch of the same members (`replica_resync`); the step is done again. Figure: the
  stall = the discarded step's neighbours' gap (the end of the step before it -> the end of the step
  done again) minus one median step. Goal: <= 2 steps.

A step is the run's median step span before the drill. `published`: the drill -> the next epoch on
the board (kill-node: the survivors told; collective-fault: the resync epoch heard of). Prints each
run, then n, median, min and max per kind and each figure against its goal.

    python benchmarks/replica_faults.py [--rounds 5]

Its record: benchmarks/records/replica_faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from controller.events import EventKind  # noqa: E402
from controller.ray.cluster import LocalRayCluster  # noqa: E402
from controller.ray.runner import drive  # noqa: E402
from controller.spec import LocalClusterSpec, parse_spec  # noqa: E402

KINDS = ("kill-node", "collective-fault")
AT, STEPS = 5, 12
CODE = ["trainer/replica.py", "trainer/membership.py", "controller/replicas.py", "controller/ray/replicas.py",
        "controller/ray/worker_group.py", "controller/state.py", "controller/ray/liveness.py"]
"""What the replica domain's figures measure: detection, the next epoch published, and the survivors' next step."""
FIGURE = {"kill-node": "SIGKILL -> the survivors' next step end", "collective-fault": "stall"}
"""Each kind's figure, in its record."""


def once(cluster: LocalRayCluster, kind: str, index: int, root: str) -> dict[str, Any]:
    spec = parse_spec({
        "name": f"{kind}-{index}",
        "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "vocab_size": 256, "seq_len": 64},
        "train": {"steps": STEPS, "global_batch": 16, "micro_batch": 2, "lr": 3e-3},
        "parallelism": {"dp": 2, "pp": 2, "tp": 2, "dp_replicas": 2},
        "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}},
        "checkpoint": {"uri": f"file://{root}", "every_steps": 5, "peer_every_steps": 1},
        "health": {"collective_timeout_s": 20, "hang_floor_s": 30},
        "elastic": {"min_dp": 1, "max_failures": 5, "failure_domain": "replica"},
        "drills": [{"kind": kind, "at_step": AT, "target": "replica:1"}],
    })
    with contextlib.redirect_stdout(sys.stderr):
        controller = drive(spec, cluster, warm_workers=True)
    run = controller.to_dict(0)
    if kind == "kill-node":
        for name in [f"node-{i}" for i in range(5)]:
            if name not in cluster._nodes:  # noqa: SLF001 - this benchmark owns its cluster
                cluster.add_node(int(name.split("-")[1]))
    if run["state"] != "succeeded" or len(run["drills"]) != 1:
        return {"ok": False, "why": f"run {run['state']} at step {run['step']}: {run['error']}"}
    (report,) = run["drills"]
    history = controller.progress.history
    before = [h["end"] - h["start"] for h in history if h["step"] <= AT and h["step"] > 1 and "end" in h]
    step = statistics.median(before)
    attempts = len(controller.events.of_kind(EventKind.ATTEMPT_STARTED))
    if kind == "kill-node":
        ok = report.get("decision") == "heal_replica" and report.get("outcome") == "recovered" and attempts == 1
        first = report["recovered_at"] - report["injected_at"]
        back = report.get("rejoined_at") or float("inf")
        # (from the step redone itself: a replica back within a step leaves no other)
        alone = [h["end"] - h["start"] for h in history if "end" in h and report["recovered_at"] - 1e-6 <= h["end"] <= back]
        alone_step = statistics.median(alone) if alone else float("nan")
        told = (report.get("survivors_told_at") or float("nan")) - report["injected_at"]
        return {"ok": ok, "why": "" if ok else f"report {report}", "step": step, "alone": alone_step,
                "detection": report["detection_s"], "told": told, "figure": first,
                "goal": report["detection_s"] + alone_step + 0.5, "goal_before": report["detection_s"] + step + 0.5}
    resyncs = controller.events.of_kind(EventKind.REPLICA_RESYNC)
    ok = report.get("decision") == "resync" and report.get("outcome") == "recovered" and attempts == 1 and resyncs
    if not ok:
        return {"ok": False, "why": f"report {report}, attempts {attempts}"}
    redone = int(resyncs[0].detail["step"])
    ends = {h["step"]: h["end"] for h in history if "end" in h}
    stall = ends[redone] - ends[redone - 1] - step
    told = resyncs[0].time - report.get("fault_at", report["injected_at"])  # (the rank held it till its step)
    return {"ok": True, "why": "", "step": step, "alone": float("nan"), "detection": report["detection_s"],
            "told": told, "figure": stall, "goal": 2 * step, "goal_before": 2 * step}


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    wrong: list[str] = []
    cluster = LocalRayCluster(LocalClusterSpec(nodes=5, gpus_per_node=2, racks=2), fast_failure_detection=True)
    with contextlib.redirect_stdout(sys.stderr):
        cluster.start()
    try:
        with tempfile.TemporaryDirectory() as root:
            for i in range(opts.rounds):
                for kind in KINDS if i % 2 == 0 else tuple(reversed(KINDS)):
                    r = once(cluster, kind, i, root)
                    if not r["ok"]:
                        wrong.append(f"round {i + 1} {kind}: {r['why']}")
                        print(f"  round {i + 1} {kind}: NOT COUNTED ({r['why']})", flush=True)
                        continue
                    results[kind].append(r)
                    what = "kill -> survivors' next step" if kind == "kill-node" else "stall"
                    print(f"  round {i + 1} {kind:>16}: step {r['step']:.2f} s (alone {r['alone']:.2f} s), detection "
                          f"{r['detection']:.2f} s, epoch published {r['told']:.2f} s, {what} {r['figure']:.2f} s "
                          f"(goal <= {r['goal']:.2f} s; with a step before the loss {r['goal_before']:.2f} s)", flush=True)
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            cluster.shutdown()
    figures: list[dict[str, Any]] = []
    for kind, rs in results.items():
        if not rs:
            continue
        print(kind)
        for key, label, name in [("step", "step s", "a step before the drill"),
                                 ("alone", "step alone s", "a step with replica 1 out"),
                                 ("detection", "detection s", "detection"), ("told", "published s", "epoch published"),
                                 ("figure", "figure s", FIGURE[kind]), ("goal", "goal s", "goal"),
                                 ("goal_before", "goal (before) s", "goal with a step before the loss")]:
            values = [float(r[key]) for r in rs]
            print(f"  {label:<16}{summary(values)}")
            measured = [v for v in values if not math.isnan(v)]  # (no step alone when nothing was lost)
            if measured:
                figures.append(records.figure(f"{kind}: {name}", measured, "s"))
        for goal, words in (("goal", "the goal"), ("goal_before", "the goal with a step before the loss")):
            met = sum(r["figure"] <= r[goal] for r in rs)
            ratio = statistics.median(r["figure"] for r in rs) / statistics.median(r[goal] for r in rs)
            print(f"  figure / {goal} (medians): {ratio:.3f}; met in {met} of {len(rs)}")
            figures += [records.figure(f"{kind}: {FIGURE[kind]} / {words} (medians)", [ratio], "ratio", goal="<= 1"),
                        records.figure(f"{kind}: rounds within {words}", [met], "count", goal=str(len(rs)))]
    print(f"runs not counted: {len(wrong)} of {opts.rounds * len(KINDS)}")
    for line in wrong:
        print("  " + line)
    if figures:
        records.write("replica_faults", figures, code=CODE, extra={"not_counted": wrong})


if __name__ == "__main__":
    main()
