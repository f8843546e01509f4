"""A kill-node healed two ways on the embedded Ray cluster, interleaved in one run, on `make run`'s
mesh (dp2 x pp2 x tp2, 5 nodes with one hot spare, tuned failure detection, warm actors):
- world: today's stop-the-world heal (`failure_domain: world`): every rank stops, the spare takes the
  lost node's place, the new attempt restores from its peers' in-memory snapshots;
- replica: `failure_domain: replica` (two replicas of pp2 x tp2): the other replica trains on, the
  lost one is formed again on the spare and takes the survivor's state.
Both paths take a peer snapshot every step (the same settings: what each costs is in the figures).
Per drill (SIGKILL of the last rank's node at step 6 of 16):
- detection: SIGKILL -> the controller's `failure_detected`;
- first step: SIGKILL -> the first step finished after it (world: the new attempt's; replica: the
  survivors', who never stopped but for the step in flight);
- whole again: SIGKILL -> every rank trains again (world: the new attempt's first step; replica:
  `replica_rejoined`);
- steps redone after the heal, and the tokens of work lost per failure: the steps redone and the
  step in flight (discarded either way), at the run's tokens per step;
- the run's ETTR and its wall time.
Rounds alternate which path runs first. Prints each drill, then n, median, min and max per path and
the ratio replica / world of the medians.

    python benchmarks/replica_heal.py [--rounds 5]

Its record: benchmarks/records/replica_heal.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from controller.events import EventKind  # noqa: E402
from controller.ray.cluster import LocalRayCluster  # noqa: E402
from controller.ray.runner import drive  # noqa: E402
from controller.spec import LocalClusterSpec, parse_spec  # noqa: E402

PATHS = {
    "world": {"failure_domain": "world"},
    "replica": {"failure_domain": "replica"},
}
KILL_AT, STEPS, GLOBAL_BATCH, SEQ = 6, 16, 16, 64
CODE = ["controller/replicas.py", "controller/ray/replicas.py", "trainer/replica.py", "controller/state.py",
        "controller/ray/worker_group.py", "controller/ray/pool.py", "trainer/peer.py", "trainer/peer_load.py"]
"""What a heal's figures measure: both failure domains' recovery, and the snapshots each heals from."""
SUMMARY = [("detection", "detection s", "s"), ("first", "first step after s", "s"), ("whole", "whole again s", "s"),
           ("tokens_lost", "tokens lost", "tokens"), ("ettr", "ETTR", "ratio"), ("wall", "run wall s", "s")]
"""(key, label, unit) of each figure per path; its name in the record is its label without the unit."""
NAME = {key: label.removesuffix(" s") for key, label, _ in SUMMARY}


def heal_once(cluster: LocalRayCluster, path: str, index: int, root: str) -> dict[str, Any]:
    replica = path == "replica"
    spec = parse_spec({
        "name": f"heal-{path}-{index}",
        "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "vocab_size": 256, "seq_len": SEQ},
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "micro_batch": 2, "lr": 3e-3},
        "parallelism": {"dp": 2, "pp": 2, "tp": 2, **({"dp_replicas": 2} if replica else {})},
        "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}},
        # The same snapshot settings on both paths (a replica's peer snapshots stay inside it).
        "checkpoint": {"uri": f"file://{root}", "every_steps": 5, "peer_every_steps": 1},
        "health": {"collective_timeout_s": 20, "hang_floor_s": 30},
        "elastic": {"min_dp": 1, "max_failures": 5, **PATHS[path]},
        "drills": [{"kind": "kill-node", "at_step": KILL_AT}],
    })
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        controller = drive(spec, cluster, warm_workers=True)
    wall = time.perf_counter() - started
    run = controller.to_dict(time.time())
    cluster.add_node(3)  # the drill killed node-3 (the last rank's node); bring it back
    if not run["drills"] or run["state"] != "succeeded":
        return {"ok": False, "why": f"run {run['state']} at step {run['step']}: {run['error']}"}
    (report,) = run["drills"]
    events = controller.events.view()
    injected = next(e.time for e in events if e.kind == EventKind.DRILL_INJECTED)
    if replica:
        rejoined = [e.time for e in events if e.kind == EventKind.REPLICA_REJOINED]
        whole = rejoined[0] - injected if rejoined else float("nan")
    else:
        whole = report.get("recovery_s", float("nan"))
    redone = report.get("steps_lost") or 0
    expected = ("heal_replica", "replica") if replica else ("replace", "peer")
    ok = (report.get("outcome") == "recovered" and report.get("decision") == expected[0]
          and report.get("restored_from") == expected[1] and run["attempt"] + 1 == (1 if replica else 2))
    return {"ok": ok, "why": "" if ok else f"report {report}, attempt {run['attempt']}",
            "detection": report.get("detection_s", float("nan")), "first": report.get("recovery_s", float("nan")),
            "whole": whole, "redone": redone, "tokens_lost": (redone + 1) * GLOBAL_BATCH * SEQ,
            "ettr": run["goodput"]["ettr"], "wall": wall}


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):8.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    wrong: list[str] = []
    cluster = LocalRayCluster(LocalClusterSpec(nodes=5, gpus_per_node=2, racks=2), fast_failure_detection=True)
    with contextlib.redirect_stdout(sys.stderr):
        cluster.start()
    try:
        with tempfile.TemporaryDirectory() as root:
            for i in range(opts.rounds):
                order = list(PATHS) if i % 2 == 0 else list(reversed(PATHS))
                for path in order:
                    r = heal_once(cluster, path, i, root)
                    if not r["ok"]:
                        wrong.append(f"round {i + 1} {path}: {r['why']}")
                        print(f"  round {i + 1} {path}: NOT COUNTED ({r['why']})", flush=True)
                        continue
                    results[path].append(r)
                    print(f"  round {i + 1} {path:>7}: detected {r['detection']:.2f} s, first step after "
                          f"{r['first']:.2f} s, whole again {r['whole']:.2f} s, {r['redone']} steps redone, "
                          f"{r['tokens_lost']} tokens lost, ETTR {r['ettr']:.3f}, wall {r['wall']:.1f} s", flush=True)
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            cluster.shutdown()
    medians: dict[str, dict[str, float]] = {}
    figures: list[dict[str, Any]] = []
    for path, rs in results.items():
        if not rs:
            continue
        print(path)
        medians[path] = {}
        for key, label, unit in SUMMARY:
            values = [float(r[key]) for r in rs]
            medians[path][key] = statistics.median(values)
            print(f"  {label:<20}{summary(values)}")
            figures.append(records.figure(f"{path}: {NAME[key]}", values, unit))
        figures.append(records.figure(f"{path}: steps redone", [r["redone"] for r in rs], "steps"))
    if len(medians) == 2:
        w, r = medians["world"], medians["replica"]
        ratios = {key: r[key] / w[key] for key in ("detection", "first", "whole", "tokens_lost", "ettr") if w[key]}
        print("ratio replica / world (medians): " + ", ".join(f"{key} {ratio:.3f}" for key, ratio in ratios.items()))
        figures += [records.figure(f"replica / world: {NAME[key]} (medians)", [ratio], "ratio")
                    for key, ratio in ratios.items()]
    print(f"drills not counted: {len(wrong)} of {opts.rounds * len(PATHS)}")
    for line in wrong:
        print("  " + line)
    if figures:
        records.write("replica_heal", figures, code=CODE, extra={"not_counted": wrong})


if __name__ == "__main__":
    main()
