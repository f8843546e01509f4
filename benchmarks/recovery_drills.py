"""kill-node drills on the embedded cluster: detection latency (raylet SIGKILL -> failure_detected)
and recovery time (SIGKILL -> first step finished on the new mesh), side by side in one run:
- goodput: tuned health checks, warm actors (a forked training process per attempt);
- fresh actors: tuned health checks, every attempt in new actors (each imports torch again);
- Ray defaults: Ray's default health checks, warm actors (the baseline for detection).
Interleaved: each round runs one drill of every configuration, in an order that rotates from round to
round (a cluster with the tuned checks serves goodput and fresh actors; one with Ray's defaults the
third), so the machine's drift falls on all three alike. Every drill's report must name the cause
(node_lost) and the decision (replace: the spare takes over); a drill that does not is counted and
left out of the figures. Prints n, median, min and max of each. Targets: median detection <= 5 s,
median recovery <= 20 s.

    python benchmarks/recovery_drills.py [--drills 5]

Its record: benchmarks/records/recovery_drills.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from controller.ray.cluster import LocalRayCluster  # noqa: E402
from controller.ray.runner import drive  # noqa: E402
from controller.spec import LocalClusterSpec, parse_spec  # noqa: E402


CONFIGS = {"goodput": (True, True), "fresh actors": (True, False), "Ray defaults": (False, True)}
"""name -> (tuned failure detection, warm actors)."""
CODE = ["controller/ray/cluster.py", "controller/ray/liveness.py", "controller/ray/heartbeats.py",
        "controller/ray/worker_group.py", "controller/ray/pool.py", "controller/ray/rank_actor.py", "controller/failure_policy.py",
        "controller/state.py"]
"""What a kill-node drill's figures measure: detection, the decision, and the relaunch on warm actors."""


def drill_on(cluster: LocalRayCluster, name: str, warm: bool, index: int, root: str) -> dict:
    spec = parse_spec({
        "name": f"drill-{name.replace(' ', '-')}-{index}",
        "model": {"n_layers": 4, "d_model": 64, "n_heads": 4, "vocab_size": 64, "seq_len": 32},
        "train": {"steps": 8, "global_batch": 8, "micro_batch": 2, "lr": 1e-2},
        "parallelism": {"dp": 2, "pp": 2, "tp": 2},
        "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}},
        "checkpoint": {"uri": f"file://{root}", "every_steps": 2},
        "health": {"collective_timeout_s": 30, "hang_floor_s": 60},
        "drills": [{"kind": "kill-node", "at_step": 3}],
    })
    with contextlib.redirect_stdout(sys.stderr):
        controller = drive(spec, cluster, warm_workers=warm)
    run = controller.to_dict(0)
    if not run["drills"]:  # the run ended before its drill: counted as a wrong drill, with why
        return {"outcome": f"no drill report: run {run['state']} at step {run['step']}: {run['error']}"}
    (report,) = run["drills"]
    cluster.add_node(3)  # the drill killed node-3 (the last rank's node); bring it back
    return report


def rounds(drills: int, root: str) -> tuple[dict[str, list[dict]], list[str]]:
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    wrong: list[str] = []
    names = list(CONFIGS)
    for i in range(drills):
        order = names[i % len(names):] + names[:i % len(names)]
        for fast in sorted({CONFIGS[n][0] for n in order}, key=lambda f: [CONFIGS[n][0] for n in order].index(f)):
            cluster = LocalRayCluster(LocalClusterSpec(nodes=5, gpus_per_node=2, racks=2), fast_failure_detection=fast)
            with contextlib.redirect_stdout(sys.stderr):
                cluster.start()
            try:
                for name in [n for n in order if CONFIGS[n][0] == fast]:
                    report = drill_on(cluster, name, CONFIGS[name][1], i, root)
                    ok = report.get("cause") == "node_lost" and report.get("decision") == "replace" \
                        and report.get("outcome") == "recovered"
                    print(f"  round {i + 1} {name}: detected {report.get('detection_s', float('nan')):.2f} s, first "
                          f"step after {report.get('recovery_s', float('nan')):.2f} s, cause {report.get('cause')}, "
                          f"decision {report.get('decision')}, {report['outcome']}", flush=True)
                    if ok:
                        results[name].append(report)
                    else:
                        wrong.append(f"round {i + 1} {name}: {report}")
            finally:
                with contextlib.redirect_stdout(sys.stderr):
                    cluster.shutdown()
    return results, wrong


def summary(name: str, values: list[float]) -> str:
    return (f"{name}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, "
            f"n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drills", type=int, default=5)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results, wrong = rounds(opts.drills, root)
    medians = {}
    figures: list[dict[str, Any]] = []
    for name, reports in results.items():
        det = [r["detection_s"] for r in reports]
        rec = [r["recovery_s"] for r in reports]
        print(name)
        print("  " + summary("detection", det))
        print("  " + summary("recovery ", rec))
        medians[name] = (statistics.median(det), statistics.median(rec))
        targets = name == "goodput"  # (the targets are goodput's)
        figures += [records.figure(f"{name}: detection", det, "s", goal="<= 5" if targets else None),
                    records.figure(f"{name}: recovery", rec, "s", goal="<= 20" if targets else None)]
    (gd, gr), (_, fr), (dd, dr) = medians["goodput"], medians["fresh actors"], medians["Ray defaults"]
    print(f"ratio goodput/Ray defaults: detection {gd / dd:.3f}, recovery {gr / dr:.3f}")
    print(f"ratio warm/fresh actors: recovery {gr / fr:.3f}")
    figures += [records.figure("goodput / Ray defaults: detection (medians)", [gd / dd], "ratio"),
                records.figure("goodput / Ray defaults: recovery (medians)", [gr / dr], "ratio"),
                records.figure("warm / fresh actors: recovery (medians)", [gr / fr], "ratio")]
    print(f"drills with the wrong cause or decision: {len(wrong)} of {opts.drills * len(CONFIGS)}")
    for line in wrong:
        print("  " + line)
    print("targets: median detection <= 5 s, median recovery <= 20 s")
    records.write("recovery_drills", figures, code=CODE, extra={"not_counted": wrong})


if __name__ == "__main__":
    main()
